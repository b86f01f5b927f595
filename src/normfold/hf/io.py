"""Hugging Face folders in and out: offline loading, example inputs, atomic saving, reloading.

A folded folder is a plain ``save_pretrained`` folder: every norm the fold turned into an RMSNorm
keeps its LayerNorm keys (explicit ones / zeros where the affine part was folded away), and an LN
on a zero-mean input computes exactly the RMSNorm. ``normfold_report.json`` records what a stock
model of the class lacks (:func:`folded_layout`: the swapped norms, norms precomputed away,
parameters the fold created), so :func:`from_pretrained` rebuilds the folded model exactly, with
the fast :class:`normfold.nn.RMSNorm` modules; stock transformers loads the same model only when
nothing but swapped norms is recorded (``"stock_compatible"``), which ``normfold fold`` ensures.
"""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import os
import shutil
import stat
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..fold.plan import PlanConstraints
from ..nn import RMSNorm
from ._deps import require

REPORT_JSON = "normfold_report.json"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CheckpointError(ValueError):
    """A folder cannot be read as a model, or the output folder cannot be written: a user error."""


def default_model_path() -> Path:
    """The bundled trained byte-level GPT-2 (see its README.md)."""
    return Path(str(resources.files("normfold") / "data" / "default_model"))


# ---------------------------------------------------------------------------------------- loading

def check_model_dir(model_dir: str | os.PathLike) -> Path:
    """The folder as a Path, or CheckpointError if it cannot hold a Hugging Face model."""
    path = Path(model_dir)
    if not path.exists():
        raise CheckpointError(f"model folder not found: {path}")
    if not path.is_dir():
        raise CheckpointError(f"expected a model folder, got a file: {path}")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"no config.json in {path}: expected a Hugging Face model folder")
    return path


def load_config(model_dir: str | os.PathLike, *, trust_remote_code: bool = False):
    transformers = require("transformers")
    path = check_model_dir(model_dir)
    try:
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"unsupported or unreadable config in {path}: {_first_line(err)}") from err


def model_class_for(config, *, trust_remote_code: bool = False) -> type:
    """The Auto class that builds ``config.architectures[0]`` (the head the folder was saved with).

    Falls back to ``AutoModel`` (the bare backbone) when the folder names no known head.
    """
    transformers = require("transformers")
    arch = (getattr(config, "architectures", None) or [None])[0]
    autos = ("AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForSeq2SeqLM",
             "AutoModelForSequenceClassification", "AutoModelForImageClassification", "AutoModel")
    for name in autos:
        auto = getattr(transformers, name)
        try:
            mapped = auto._model_mapping[type(config)]
        except (KeyError, ValueError):
            continue
        classes = mapped if isinstance(mapped, tuple) else (mapped,)  # DeiT, Funnel: several heads per config
        named = [cls for cls in classes if arch is None or cls.__name__ == arch]
        if named:
            return auto if trust_remote_code else named[0]
    if trust_remote_code:
        return transformers.AutoModel
    try:
        mapped = transformers.AutoModel._model_mapping[type(config)]
        return mapped[0] if isinstance(mapped, tuple) else mapped
    except (KeyError, ValueError) as err:
        raise CheckpointError(f"unsupported architecture {arch or config.model_type!r}: transformers has no model class for it") from err


def load_model(model_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
               trust_remote_code: bool = False) -> nn.Module:
    """Load a folder offline (``local_files_only``) in ``dtype``, eval mode, eager attention.

    Eager attention because ``torch.export`` + decompositions fail on SDPA for some models.
    """
    path = check_model_dir(model_dir)
    config = load_config(path, trust_remote_code=trust_remote_code)
    cls = model_class_for(config, trust_remote_code=trust_remote_code)
    _check_weight_files(path)
    try:
        model = cls.from_pretrained(path, config=config, local_files_only=True, trust_remote_code=trust_remote_code,
                                    dtype=dtype, attn_implementation="eager")
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, AttributeError, NotImplementedError) as err:
        raise CheckpointError(f"could not load the weights in {path}: {_first_line(err)}") from err
    return model.eval()


def _check_weight_files(path: Path) -> None:
    """Refuse folders whose weights would need pickle, and detect corrupt safetensors early."""
    safetensors = sorted(path.glob("*.safetensors"))
    if not safetensors and not list(path.glob("*.bin")):
        raise CheckpointError(f"no weights in {path}: expected *.safetensors (or *.bin)")
    safe_open = require("safetensors").safe_open
    for file in safetensors:
        try:
            with safe_open(file, framework="pt") as f:
                f.keys()
        except Exception as err:  # safetensors raises its own SafetensorError for corrupt headers
            raise CheckpointError(f"corrupt safetensors file {file}: {_first_line(err)}") from err
    if not safetensors:
        # transformers loads .bin with torch.load(weights_only=True); say so rather than trust it silently
        for file in path.glob("*.bin"):
            try:
                torch.load(file, map_location="meta", weights_only=True, mmap=True)
            except Exception as err:
                raise CheckpointError(f"{file} is not a weights-only torch checkpoint: {_first_line(err)}") from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]


# ---------------------------------------------------------------------------------- example inputs

def example_inputs_for(model_or_config, batch: int = 2, seq: int = 16, *, seed: int = 0) -> dict[str, Any]:
    """Keyword inputs for one forward pass, built from the model's modality and config: token ids
    (+ attention mask) for text, pixel values for vision, waveforms (``input_values``) or log-mel
    features (``input_features``) for audio, ids and pixels together for two-tower models (CLIP,
    SigLIP); decoder ids for encoder-decoders and ``use_cache=False``.

    Deterministic (seeded); the values are random: folding is exact for any input.
    """
    if isinstance(model_or_config, nn.Module):
        config, forward = model_or_config.config, type(model_or_config).forward
    else:
        config = model_or_config
        forward = model_class_for(config).forward
    params = inspect.signature(forward).parameters
    gen = torch.Generator().manual_seed(seed)
    inputs: dict[str, Any] = {}
    if "pixel_values" in params:
        inputs["pixel_values"] = _pixel_values(getattr(config, "vision_config", None) or config, batch, gen)
    elif "input_values" in params:
        inputs["input_values"] = _waveform(getattr(config, "audio_config", None) or config, batch, seq, gen)
    elif "input_features" in params:
        inputs["input_features"] = _log_mel_features(getattr(config, "audio_config", None) or config, batch, gen)
    two_towers = "pixel_values" in inputs and getattr(config, "text_config", None) is not None
    if "input_ids" in params and (not inputs or two_towers):
        ids = _token_ids(config.get_text_config(), batch, seq, gen)
        inputs["input_ids"] = ids
        if "attention_mask" in params:
            inputs["attention_mask"] = torch.ones_like(ids)
    if not inputs:
        raise CheckpointError(f"cannot build example inputs for {type(config).__name__}: its forward takes none of "
                              f"input_ids, pixel_values, input_values, input_features")
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        inputs["decoder_input_ids"] = _token_ids(config.get_text_config(decoder=True), batch, seq, gen)
    if "use_cache" in params:
        inputs["use_cache"] = False  # no KV cache objects in the captured graph
    return inputs


CHARACTER_VOCAB = 128  # models that read characters (Canine: Unicode code points) have no vocab_size: ASCII ids


def _token_ids(text_config, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """(B, T) random ids below the vocabulary size, T at most the model's positions (a value <= 0,
    XLNet's ``max_position_embeddings=-1``, means unbounded)."""
    vocab = getattr(text_config, "vocab_size", None) or CHARACTER_VOCAB
    limits = (getattr(text_config, name, None) for name in ("max_position_embeddings", "n_positions"))
    length = min([seq] + [v for v in limits if isinstance(v, int) and v > 0])
    return torch.randint(0, vocab, (batch, length), generator=gen)


def _pixel_values(vision_config, batch: int, gen: torch.Generator) -> torch.Tensor:
    """(B, C, H, W) random pixels at the config's image size (an int or (H, W))."""
    size = getattr(vision_config, "image_size", None) or 224
    h, w = (size, size) if isinstance(size, int) else tuple(size)[-2:]
    return torch.randn(batch, getattr(vision_config, "num_channels", 3), h, w, generator=gen)


def _waveform(audio_config, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """(B, S) random samples, S the fewest the convolutional feature encoder turns into ``seq`` frames:
    each conv maps L to (L - k) // s + 1, so walking back L = (L' - 1) * s + k."""
    samples = seq
    for kernel, stride in reversed(list(zip(getattr(audio_config, "conv_kernel", ()), getattr(audio_config, "conv_stride", ())))):
        samples = (samples - 1) * stride + kernel
    return torch.randn(batch, samples, generator=gen)


def _log_mel_features(audio_config, batch: int, gen: torch.Generator) -> torch.Tensor:
    """(B, mel bins, frames) random features; Whisper-style encoders expect exactly 2 x their positions."""
    frames = 2 * getattr(audio_config, "max_source_positions", 1500)
    return torch.randn(batch, getattr(audio_config, "num_mel_bins", 80), frames, generator=gen)


# ------------------------------------------------------------------------------- calibration text

CALIBRATION_BATCH = 16  # sentences per calibration batch: small enough for CPU memory, large enough to be fast
CALIBRATION_MAX_TOKENS = 128  # longer sentences are truncated: calibration needs typical tokens, not long contexts


def read_calibration_file(path: str | os.PathLike) -> list[str]:
    """The non-blank lines of a UTF-8 text file, one calibration sentence each."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"calibration file not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"calibration file {path} is not readable UTF-8 text: {_first_line(err)}") from err
    sentences = [line.strip() for line in lines if line.strip()]
    if not sentences:
        raise CheckpointError(f"calibration file {path} is empty: expected one sentence per line")
    return sentences


# a folder holds a tokenizer when it has one of these (transformers 5 otherwise builds an empty one from config.json)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model",
                    "spiece.model", "sentencepiece.bpe.model")


def load_tokenizer(model_dir: str | os.PathLike, *, trust_remote_code: bool = False):
    """The folder's own tokenizer (offline), or CheckpointError when the folder has none."""
    transformers = require("transformers")
    path = check_model_dir(model_dir)
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise CheckpointError(f"no tokenizer in {path} (needed to tokenize the calibration file): expected one of "
                              f"{', '.join(_TOKENIZER_FILES)}")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True,
                                                               trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"no usable tokenizer in {path} (needed to tokenize the calibration file): "
                              f"{_first_line(err)}") from err
    if tokenizer is None or not callable(tokenizer):
        raise CheckpointError(f"no usable tokenizer in {path} (needed to tokenize the calibration file)")
    return tokenizer


def calibration_batches(model: nn.Module, tokenizer, sentences: list[str],
                        batch_size: int = CALIBRATION_BATCH) -> list[dict[str, Any]]:
    """The sentences tokenized in padded batches, as keyword inputs ``model`` accepts."""
    params = inspect.signature(type(model).forward).parameters
    text = getattr(model.config, "get_text_config", lambda: model.config)()
    max_len = min(v for v in (getattr(text, "max_position_embeddings", None), getattr(text, "n_positions", None),
                              CALIBRATION_MAX_TOKENS) if v)
    if tokenizer.pad_token is None:  # e.g. GPT-2: pad with EOS, the attention mask hides it
        tokenizer.pad_token = tokenizer.eos_token
    batches = []
    for start in range(0, len(sentences), batch_size):
        encoded = tokenizer(sentences[start:start + batch_size], padding=True, truncation=True, max_length=max_len,
                            return_tensors="pt")
        batch = {k: v for k, v in encoded.items() if k in params}  # (B, T) each
        if "use_cache" in params:
            batch["use_cache"] = False
        batches.append(batch)
    return batches


def is_sentence_encoder(model: nn.Module) -> bool:
    """A bare encoder backbone (what ``AutoModel`` builds for BERT-like configs): no LM head, its
    token states are pooled into sentence embeddings, so its outputs are compared mean-pooled."""
    transformers = require("transformers")
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return False
    try:
        backbone = transformers.AutoModel._model_mapping[type(config)]
        transformers.AutoModelForMaskedLM._model_mapping[type(config)]  # an encoder family
    except (KeyError, ValueError):
        return False
    return type(model) is backbone


# ----------------------------------------------------------------------------------------- saving

TEMP_MARK = ".normfold-tmp-"  # temporary siblings are named .<out name>.normfold-tmp-XXXXXXXX
_HAS_FLOCK = importlib.util.find_spec("fcntl") is not None  # POSIX; not on Windows


def check_output_dir(out_dir: str | os.PathLike, *, overwrite: bool = False,
                     protect: tuple[str | os.PathLike, ...] = ()) -> Path:
    """``out_dir`` as an absolute path, or CheckpointError when writing it could lose data.

    Refused: the output is a protected folder (the input model), inside one or an ancestor of one
    (replacing ``work`` would delete ``work/models/m``); a symbolic link; an existing file; an
    existing folder without ``overwrite``; with ``overwrite``, a folder that is neither empty nor
    a previous normfold output (one holding ``normfold_report.json``).
    """
    out = Path(os.path.abspath(out_dir))
    real = out.resolve()
    for p in protect:
        p = Path(p).resolve()
        if real == p or p in real.parents:
            raise CheckpointError(f"refusing to write into the input model folder {p}: pick another -o")
        if real in p.parents:
            raise CheckpointError(f"refusing to write {out}: it contains the input model folder {p}, "
                                  "which replacing it would delete; pick another -o")
    if out.is_symlink():
        raise CheckpointError(f"output path is a symbolic link: {out} (pass the folder it points to)")
    if not out.exists():
        return out
    if not out.is_dir():
        raise CheckpointError(f"output path exists and is not a folder: {out}")
    if not overwrite:
        raise CheckpointError(f"output folder exists: {out} (pass --overwrite to replace it)")
    if any(out.iterdir()) and not (out / REPORT_JSON).is_file():
        raise CheckpointError(f"refusing to replace {out}: it is not empty and holds no {REPORT_JSON}, so it is not "
                              "a normfold output (--overwrite only replaces those)")
    return out


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike, *, overwrite: bool = False,
                      protect: tuple[str | os.PathLike, ...] = ()) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``out_dir``; publish it as ``out_dir`` when the block
    finishes without an exception, so that ``out_dir`` only ever holds a complete output.

    Checks :func:`check_output_dir` first. The old output is replaced by one atomic exchange
    (Linux ``renameat2(RENAME_EXCHANGE)``), so a kill at any moment leaves ``out_dir`` either old
    or new, and the old one is deleted only after the exchange. On an exception the temporary
    folder is removed and ``out_dir`` is untouched. The temporary folder is locked (``flock``)
    while in use; folders a killed run left (``.<name>.normfold-tmp-*`` that nobody holds) are
    removed by the next run. The output folder gets the umask's permissions, like ``mkdir``.
    """
    out = check_output_dir(out_dir, overwrite=overwrite, protect=protect)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(out)
        tmp, lock = _locked_temporary(out)
    except OSError as err:  # e.g. a read-only parent: a user error, said before any work
        raise CheckpointError(f"cannot write a folder next to {out}: {_first_line(err)}") from err
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            os.close(lock)


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Remove the temporary siblings of ``out`` that no running normfold holds; returns them.
    Without ``flock`` (Windows) nothing tells a live run's folder from a dead one's: none is removed."""
    removed = []
    for p in out.parent.iterdir():
        if not p.name.startswith(f".{out.name}{TEMP_MARK}") or p.is_symlink() or not p.is_dir():
            continue
        lock = _try_lock(p)
        if lock is None:  # in use by another run (or just vanished)
            continue
        try:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        finally:
            os.close(lock)
    return removed


def _locked_temporary(out: Path) -> tuple[Path, int | None]:
    """A new temporary sibling of ``out`` and the descriptor holding its lock (None without ``flock``).

    A concurrent run's cleanup may take the lock of (and remove) a folder between its creation
    and our lock: then it is not ours any more, and we make another.
    """
    while True:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}{TEMP_MARK}", dir=out.parent))
        if not _HAS_FLOCK:
            return tmp, None
        lock = _try_lock(tmp)
        if lock is not None:
            return tmp, lock


def _try_lock(folder: Path) -> int | None:
    """An open descriptor of ``folder`` holding an exclusive ``flock``, or None when another
    process holds it or the folder is gone. The lock dies with the process that holds it."""
    if not _HAS_FLOCK:
        return None
    import fcntl

    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.path.samestat(os.fstat(fd), os.stat(folder)):  # still the folder at that name
            return fd
    except OSError:  # BlockingIOError: held elsewhere; FileNotFoundError: removed meanwhile
        pass
    os.close(fd)
    return None


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out``; an existing ``out`` is exchanged with it atomically
    and deleted afterwards (it then sits at ``tmp``'s name, where a later run would clean it)."""
    if not out.exists():
        try:
            os.rename(tmp, out)
        except OSError as err:  # a non-empty folder appeared at out meanwhile: never merge into it
            raise CheckpointError(f"output folder {out} appeared while writing: {_first_line(err)}") from err
        return
    if not _exchange(tmp, out):  # no atomic exchange here: two renames, out missing in between
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.normfold-old-", dir=out.parent))  # not cleaned by others
        os.rename(out, old / out.name)
        os.rename(tmp, out)
        tmp = old
    shutil.rmtree(tmp, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2`` with ``RENAME_EXCHANGE``); False where unsupported."""
    import ctypes
    import errno

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def swapped_norms(model: nn.Module) -> list[dict[str, Any]]:
    """Where ``model`` holds normfold RMSNorms and which affine parameters they kept."""
    return [
        {"path": name, "normalized_shape": list(m.normalized_shape), "eps": m.eps,
         "weight": m.weight is not None, "bias": m.bias is not None}
        for name, m in model.named_modules() if isinstance(m, RMSNorm)
    ]


def stock_state_dict(folded: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The folded weights under the keys the stock architecture expects.

    A weightless RMSNorm where the stock model has a LayerNorm gets weight = 1 and bias = 0:
    LN(x)·1 + 0 on a zero-mean x is exactly the weightless RMSNorm. So does a LayerNorm the fold kept
    but whose γ/β it moved into the next layer (:func:`_affine_moved_away`): LN(x)·1 + 0 is that LN.
    """
    stock_keys = stock_parameter_shapes(folded.config, type(folded))
    state = {k: v for k, v in folded.state_dict().items()}
    norms = {s["path"]: s for s in swapped_norms(folded)}
    for key, shape in stock_keys.items():
        if key in state:
            continue
        path, _, leaf = key.rpartition(".")
        if (path in norms and leaf in ("weight", "bias")) or _affine_moved_away(folded, key):
            fill = torch.ones if leaf == "weight" else torch.zeros
            state[key] = fill(shape, dtype=dtype or next(folded.parameters()).dtype)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    # save_pretrained shares storage between tied tensors; untied ones must not alias
    return {k: v.contiguous() for k, v in state.items()}


def _affine_moved_away(model: nn.Module, name: str) -> bool:
    """True when parameter ``name`` is the γ or β of a LayerNorm of ``model`` that no longer has it:
    the fold kept that norm a LayerNorm and moved its affine into the next layer, so a stock model
    holding γ = 1, β = 0 there computes exactly the same."""
    path, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return False
    return isinstance(module, nn.LayerNorm) and leaf in ("weight", "bias") and getattr(module, leaf, None) is None


def stock_parameter_shapes(config, cls: type) -> dict[str, torch.Size]:
    """State-dict keys and shapes of the stock model for ``config`` (built on the meta device: no memory)."""
    with torch.device("meta"):
        stock = cls._from_config(config)
    return {k: v.shape for k, v in stock.state_dict().items()}


def untie_config(model: nn.Module) -> None:
    """Set ``tie_word_embeddings=False`` when the fold gave the output embedding its own tensor."""
    config = model.config
    emb_in, emb_out = _embedding(model, "get_input_embeddings"), _embedding(model, "get_output_embeddings")
    if emb_in is None or emb_out is None:
        return
    if emb_in.weight is not emb_out.weight and getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False
        text = getattr(config, "get_text_config", lambda: config)()
        if text is not config:
            text.tie_word_embeddings = False


def _embedding(model: nn.Module, getter: str) -> nn.Module | None:
    """``model.get_input_embeddings()`` (or output), None where the model has none: vision models
    (MobileViT, SegFormer) raise NotImplementedError, others return None or lack the method."""
    try:
        return getattr(model, getter)()
    except (AttributeError, NotImplementedError):
        return None


def save_folded(folded: nn.Module, out_dir: Path, *, dtype: torch.dtype | None = None) -> None:
    """``save_pretrained`` (safetensors) of the folded model in stock-loadable form, into ``out_dir``.

    Parameters the stock class lacks (``folded_layout(folded)["extra_parameters"]``) are stored too.
    """
    untie_config(folded)
    state = stock_state_dict(folded, dtype)
    config_dtype = getattr(folded.config, "dtype", None)
    if dtype is not None:
        folded.config.dtype = dtype
    try:
        folded.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
    finally:  # the caller's model keeps its own config
        folded.config.dtype = config_dtype


def folded_layout(folded: nn.Module) -> dict[str, Any]:
    """How ``folded`` differs from a stock model of its class built from its config, recorded in
    ``normfold_report.json`` so that :func:`from_pretrained` can rebuild it exactly:

    - ``swapped``: the normfold RMSNorms (:func:`swapped_norms`);
    - ``identity``: norms the fold precomputed into a table, now ``nn.Identity``;
    - ``extra_parameters``: parameters the fold created where the stock class has none (``lm_head.bias``
      when ``normfold.fold`` moved GPT-2's ln_f γ/β into the head), ``[{"name", "shape"}]``;
    - ``stock_compatible``: no identity and no extra parameters, so stock ``from_pretrained`` builds the
      same model (each swapped RMSNorm comes back as the LayerNorm it equals on its zero-mean input).

    Raises ValueError for any other difference (a module of another class, a parameter the stock model
    has and ``folded`` lacks): :func:`from_pretrained` could not rebuild it.
    """
    with torch.device("meta"):
        stock = type(folded)._from_config(folded.config)
    stock_modules = dict(stock.named_modules())
    swapped = swapped_norms(folded)
    swapped_paths = {s["path"] for s in swapped}
    identity, problems = [], []
    for path, module in folded.named_modules():
        ref = stock_modules.get(path)
        if ref is not None and path in swapped_paths:
            continue
        if ref is not None and isinstance(module, nn.Identity) and not isinstance(ref, nn.Identity):
            identity.append(path)
        elif ref is None or type(ref) is not type(module):
            problems.append(f"{path or 'the model'} is a {type(module).__name__} where {type(stock).__name__} has "
                            f"{'nothing' if ref is None else 'a ' + type(ref).__name__}")
    stock_params = {name for name, _ in stock.named_parameters(remove_duplicate=False)}
    params = dict(folded.named_parameters(remove_duplicate=False))
    extra = [{"name": name, "shape": list(p.shape)} for name, p in params.items() if name not in stock_params]
    rebuilt_away = tuple(f"{path}." for path in (*identity, *swapped_paths))  # from_pretrained drops these
    problems += [f"{name} is missing" for name in sorted(stock_params - set(params))
                 if not name.startswith(rebuilt_away) and not _affine_moved_away(folded, name)]
    stock_state = set(stock.state_dict())
    problems += [f"buffer {name} is new" for name in folded.state_dict() if name not in stock_state and name not in params]
    if problems:
        raise ValueError(f"cannot save {type(folded).__name__} so that normfold.from_pretrained rebuilds it: "
                         f"{'; '.join(problems[:5])}{' ...' if len(problems) > 5 else ''}")
    return {"swapped": swapped, "identity": identity, "extra_parameters": extra,
            "stock_compatible": not identity and not extra}


def save_pretrained(folded: nn.Module, out_dir: str | os.PathLike, *, dtype: torch.dtype | str | None = None,
                    source_dir: str | os.PathLike | None = None, report=None,
                    overwrite: bool = False) -> dict[str, Any]:
    """Save a folded Hugging Face model so that :func:`normfold.from_pretrained` rebuilds exactly it.

    ``out_dir`` becomes a ``save_pretrained`` folder (safetensors) plus ``normfold_report.json``,
    which records what a stock model of the class lacks (:func:`folded_layout`: the RMSNorms, norms
    precomputed away, parameters the fold created such as ``lm_head.bias``; those are in the weights).
    Stock ``from_pretrained`` loads the same model when the fold fits the stock class (``normfold
    fold`` and :func:`normfold.hf.folder.fold_for_stock` make such folds); otherwise a
    ``UserWarning`` says what stock transformers would drop or rebuild.

    Args:
        dtype: storage dtype (``torch.float32`` / ``float16`` / ``bfloat16`` or its name); default: as is.
        source_dir: the folder the original model came from: its other files (tokenizer, generation
            config, sentence-transformers modules, README, ...) are carried over by
            :func:`copy_side_files`; links and other skipped files are warned about.
        report: the ``FoldReport`` of ``normfold.fold``, written into ``normfold_report.json``
            (approximately replaced norms are marked, and counted as not stock-compatible).
        overwrite: replace an existing ``out_dir`` (only an empty folder or a previous normfold output).

    The folder is written beside ``out_dir`` and renamed into place when complete: on any error
    nothing appears. Returns the report written.
    """
    from ..fold import FoldReport

    if not isinstance(folded, nn.Module) or not callable(getattr(folded, "save_pretrained", None)) \
            or not hasattr(folded, "config"):
        raise TypeError(f"folded must be a Hugging Face model (a transformers PreTrainedModel), got "
                        f"{type(folded).__name__}; save other models with torch.save(folded.state_dict(), ...)")
    save_dtype = _storage_dtype(dtype)
    if report is not None and not isinstance(report, FoldReport):
        raise TypeError(f"report must be the FoldReport of normfold.fold, got {type(report).__name__}")
    source = None if source_dir is None else check_model_dir(source_dir)
    record = {} if report is None else report.to_dict()
    record.update(folded_layout(folded))
    if report is not None and report.approximate is not None:
        from .folder import _approximate_summary

        record.update(_approximate_summary(report.approximate, record["swapped"]))
    record["saved_dtype"] = str(save_dtype or next(folded.parameters()).dtype).replace("torch.", "")
    if not record["stock_compatible"]:
        warnings.warn(_stock_incompatibility(type(folded).__name__, record), UserWarning, stacklevel=2)
    with atomic_output_dir(out_dir, overwrite=overwrite, protect=() if source is None else (source,)) as tmp:
        save_folded(folded, tmp, dtype=save_dtype)
        if source is not None:
            record["skipped_files"] = copy_side_files(source, tmp)
            if record["skipped_files"]:
                listed = ", ".join(f"{s['path']} ({s['reason']})" for s in record["skipped_files"])
                warnings.warn(f"not copied from {source}: {listed}", UserWarning, stacklevel=2)
        (tmp / REPORT_JSON).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return record


def _storage_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype`` as one of :data:`DTYPES`, or ValueError naming the accepted ones."""
    if dtype is None or dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.replace("torch.", "") in DTYPES:
        return DTYPES[dtype.replace("torch.", "")]
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or None: as stored), got {dtype!r}")


def _stock_incompatibility(cls_name: str, record: Mapping[str, Any]) -> str:
    """The warning for a folded model that stock ``from_pretrained`` would load as another model."""
    what = []
    if record["extra_parameters"]:
        what.append(f"drop {', '.join(e['name'] for e in record['extra_parameters'])} ({cls_name} has no such "
                    "parameter)")
    if record["identity"]:
        what.append(f"rebuild {', '.join(record['identity'])} as norms (the fold precomputed them into a table)")
    if record.get("num_approximate"):
        what.append(f"rebuild the approximate RMSNorms {', '.join(record['approximate_norms'])} as LayerNorms")
    return (f"stock transformers would {' and '.join(what)}, so {cls_name}.from_pretrained on this folder gives a "
            "different model: load it with normfold.from_pretrained, or fold with the stock-compatible plan "
            "(normfold.hf.folder.fold_for_stock(model, example_inputs), what `normfold fold` does)")


# -------------------------------------------------------------------------------------- side files

# Weight files. At the top of the input folder they hold the model being folded; in subfolders, the
# unfolded model in another format (onnx/, openvino/): never carried over, except with the modules of
# a sentence-transformers pipeline (2_Dense/), which the fold does not touch.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".onnx", ".onnx_data",
                   ".gguf", ".tflite", ".ot", ".npz", ".pb", ".pkl", ".pickle")


def copy_side_files(source_dir: str | os.PathLike, out_dir: str | os.PathLike) -> list[dict[str, str]]:
    """Carry every file of ``source_dir`` that is not a weight file over into ``out_dir``, subfolders
    included (tokenizer, generation config, README, sentence-transformers ``modules.json``,
    ``1_Pooling/``, ...), so that the folded folder is as usable as the original.

    Copied: regular files inside ``source_dir``, and, in a Hugging Face hub cache snapshot
    (``models--org--name/snapshots/<rev>/``, whose files are links into the repository's own
    ``blobs/``), links that resolve to a regular file of that ``blobs/`` folder. Skipped and returned
    as ``[{"path", "reason"}]``: other links (even to files inside: ``README.md -> ../secret.txt`` must
    not publish the secret), devices and pipes, hidden folders (``.git``), weight files in subfolders.
    Skipped silently: the top-level
    weights and what the fold writes itself (``config.json``, ``*.index.json``, ``normfold_*``); a
    file already in ``out_dir`` is the fold's own and is kept. Every folder and file is opened relative
    to its parent's descriptor without following links, so a link swapped in meanwhile is refused too,
    and nothing is written outside ``out_dir``.
    """
    skipped: list[dict[str, str]] = []
    blobs = _hub_blobs_folder(Path(source_dir))
    source = _Source(Path(source_dir), _pipeline_module_folders(Path(source_dir), blobs), blobs)
    src_fd = os.open(source_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        dst_fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            _copy_folder(src_fd, dst_fd, "", source, skipped)
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)
    return skipped


@dataclass(frozen=True)
class _Source:
    """What :func:`copy_side_files` knows of the folder it copies from."""

    root: Path
    pipeline: set[str]       # sentence-transformers module folders (their weights are carried over)
    blobs: Path | None       # the hub cache's blobs/ folder when root is a snapshot of it, else None

    def hub_blob(self, rel_path: str) -> Path | None:
        """The blob a snapshot link points to: a regular file directly in ``blobs``, else None."""
        if self.blobs is None:
            return None
        target = Path(os.path.realpath(self.root / rel_path))
        if target.parent != self.blobs or target.is_symlink() or not target.is_file():
            return None
        return target


def _hub_blobs_folder(source: Path) -> Path | None:
    """``<repo>/blobs`` when ``source`` is ``<repo>/snapshots/<rev>`` of a Hugging Face hub cache."""
    source = Path(os.path.realpath(source))
    blobs = source.parent.parent / "blobs"
    if source.parent.name != "snapshots" or blobs.is_symlink() or not blobs.is_dir():
        return None
    return blobs


def _pipeline_module_folders(source: Path, blobs: Path | None) -> set[str]:
    """The folders of a sentence-transformers pipeline (``modules.json``: ``1_Pooling``, ``2_Dense``, ...)."""
    modules_file = source / "modules.json"
    foreign_link = modules_file.is_symlink() and (blobs is None or Path(os.path.realpath(modules_file)).parent != blobs)
    if foreign_link or not modules_file.is_file():
        return set()
    try:
        paths = {m["path"] for m in json.loads(modules_file.read_text())}
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError):
        return set()  # not a pipeline normfold can read: carried over as a plain file
    return {p for p in paths if isinstance(p, str) and p and os.sep not in p and "/" not in p and p not in (".", "..")}


def _copy_folder(src_fd: int, dst_fd: int, rel: str, source: _Source, skipped: list[dict[str, str]],
                 keep_weights: bool = False) -> int:
    """Copy the folder at ``src_fd`` into the one at ``dst_fd`` by :func:`copy_side_files`' rules;
    ``rel`` is its path in the source (``""`` at the top). Returns the number of files copied."""
    copied = 0
    with os.scandir(src_fd) as entries:
        names = sorted(entry.name for entry in entries)
    for name in names:
        path = f"{rel}{name}"
        try:
            mode = os.stat(name, dir_fd=src_fd, follow_symlinks=False).st_mode
        except FileNotFoundError:  # removed since the listing
            continue
        blob = source.hub_blob(path) if stat.S_ISLNK(mode) else None
        if stat.S_ISLNK(mode) and blob is None:
            skipped.append({"path": path, "reason": "symbolic link, not followed"})
        elif stat.S_ISDIR(mode):
            if name.startswith("."):
                skipped.append({"path": path + "/", "reason": "hidden folder"})
                continue
            copied += _copy_subfolder(src_fd, dst_fd, name, f"{path}/", source, skipped,
                                      keep_weights or (not rel and name in source.pipeline))
        elif not stat.S_ISREG(mode) and blob is None:
            skipped.append({"path": path, "reason": "not a regular file"})
        elif not rel and (name == "config.json" or name.endswith(".index.json") or name.startswith("normfold_")):
            continue  # written by the fold itself
        elif name.endswith(WEIGHT_SUFFIXES) and not keep_weights:
            if rel:
                skipped.append({"path": path, "reason": "weight file of the unfolded model"})
        elif blob is not None:  # a hub cache snapshot's link to its own blob: the blob's content under this name
            blobs_fd = os.open(blob.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                copied += _copy_file(blobs_fd, dst_fd, name, path, skipped, source_name=blob.name)
            finally:
                os.close(blobs_fd)
        else:
            copied += _copy_file(src_fd, dst_fd, name, path, skipped)
    return copied


def _copy_subfolder(src_fd: int, dst_fd: int, name: str, rel: str, source: _Source,
                    skipped: list[dict[str, str]], keep_weights: bool) -> int:
    """:func:`_copy_folder` into ``name`` under ``dst_fd`` (created here, removed again if left empty)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        sub_src = os.open(name, flags, dir_fd=src_fd)
    except OSError as err:  # replaced by a link or removed since the listing
        skipped.append({"path": rel, "reason": f"not readable: {err.strerror}"})
        return 0
    try:
        created = _make_folder(name, dst_fd)
        sub_dst = os.open(name, flags, dir_fd=dst_fd)
        try:
            copied = _copy_folder(sub_src, sub_dst, rel, source, skipped, keep_weights)
        finally:
            os.close(sub_dst)
        if created and not copied:
            os.rmdir(name, dir_fd=dst_fd)
        return copied
    finally:
        os.close(sub_src)


def _make_folder(name: str, dst_fd: int) -> bool:
    """Create folder ``name`` under ``dst_fd``; False when the fold already made it."""
    try:
        os.mkdir(name, dir_fd=dst_fd)
    except FileExistsError:
        return False
    return True


def _copy_file(src_fd: int, dst_fd: int, name: str, path: str, skipped: list[dict[str, str]],
               source_name: str | None = None) -> int:
    """Copy regular file ``source_name`` (default ``name``) to ``name`` (1) unless it is no longer one,
    or ``out`` already has it (0)."""
    try:  # O_NONBLOCK: a pipe swapped in since the listing must not block the open
        fd = os.open(source_name or name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=src_fd)
    except OSError as err:  # ELOOP: a link swapped in since the listing
        skipped.append({"path": path, "reason": f"not readable: {err.strerror}"})
        return 0
    with open(fd, "rb") as source:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            skipped.append({"path": path, "reason": "not a regular file"})
            return 0
        try:
            out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666, dir_fd=dst_fd)
        except FileExistsError:  # written by the fold (generation_config.json): its own version wins
            return 0
        with open(out, "wb") as target:
            shutil.copyfileobj(source, target, 1 << 20)
    return 1


# ---------------------------------------------------------------------------------------- reloading

def from_pretrained(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                    trust_remote_code: bool = False) -> nn.Module:
    """Load a folder written by ``normfold fold`` or :func:`save_pretrained`, rebuilt as it was folded.

    ``normfold_report.json`` says what stock transformers would build differently
    (:func:`folded_layout`): :class:`normfold.nn.RMSNorm` goes back where the fold swapped one
    (approximate replacements, ``--approximate``, included: stock transformers would load those as
    LayerNorms, which is a different model), ``nn.Identity`` where a norm was precomputed away, and
    the parameters the fold created (``lm_head.bias``) are read from the folder's weights.
    Raises CheckpointError when the weights lack a tensor the rebuilt model needs (stock
    transformers would initialise it at random and only log it).
    """
    path = check_model_dir(path)
    layout = _read_layout(path)
    stored = _stored_tensors(path)
    missing = [e["name"] for e in layout["extra_parameters"] if e["name"] not in stored]
    if missing:
        raise CheckpointError(f"{path / REPORT_JSON} lists parameters the weights in {path} do not hold: "
                              f"{', '.join(missing)}")
    model = load_model(path, dtype=dtype, trust_remote_code=trust_remote_code)
    try:
        for module_path in layout["identity"]:
            parent_path, _, attr = module_path.rpartition(".")
            setattr(model.get_submodule(parent_path), attr, nn.Identity())
        for entry in layout["swapped"]:
            swap_in_rmsnorm(model, entry)
    except AttributeError as err:
        raise CheckpointError(f"{path / REPORT_JSON} names a module {type(model).__name__} does not have: "
                              f"{_first_line(err)}") from err
    for entry in layout["extra_parameters"]:
        _restore_parameter(model, entry, stored)
    _check_every_parameter_stored(model, stored, path)
    return model


def _read_layout(path: Path) -> dict[str, Any]:
    """The :func:`folded_layout` keys of the folder's report (older reports have only ``swapped``)."""
    report_file = path / REPORT_JSON
    if not report_file.is_file():
        raise CheckpointError(f"no {REPORT_JSON} in {path}: not a folder written by `normfold fold` or "
                              "normfold.save_pretrained")
    try:
        report = json.loads(report_file.read_text())
        layout = {"swapped": list(report["swapped"]), "identity": [str(p) for p in report.get("identity", [])],
                  "extra_parameters": [{"name": str(e["name"]), "shape": [int(n) for n in e["shape"]]}
                                       for e in report.get("extra_parameters", [])]}
        for entry in layout["swapped"]:
            absent = {"path", "normalized_shape", "eps", "weight", "bias"} - set(entry)
            if absent:
                raise KeyError(f"a swapped entry lacks {', '.join(sorted(absent))}")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{report_file} is not a normfold report: {_first_line(err)}") from err
    return layout


def _stored_tensors(path: Path) -> dict[str, Path]:
    """Tensor name -> the weight file holding it, for the files transformers loads from ``path``."""
    for index, single in (("model.safetensors.index.json", "model.safetensors"),
                          ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if (path / index).is_file():
            try:
                weight_map = json.loads((path / index).read_text())["weight_map"]
                files = {name: str(file) for name, file in weight_map.items()}
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
                raise CheckpointError(f"{path / index} is not a weight index: {_first_line(err)}") from err
            bad = sorted({f for f in files.values() if Path(f).name != f or f in (".", "..")})
            if bad:
                raise CheckpointError(f"{path / index} names weight files outside {path}: {', '.join(bad)}")
            return {name: path / file for name, file in files.items()}
        if (path / single).is_file():
            return dict.fromkeys(_tensor_names(path / single), path / single)
    raise CheckpointError(f"no weights in {path}: expected model.safetensors (or pytorch_model.bin), or an index")


def _tensor_names(file: Path) -> list[str]:
    try:
        if file.suffix == ".safetensors":
            with require("safetensors").safe_open(file, framework="pt") as f:
                return list(f.keys())
        return list(torch.load(file, map_location="meta", weights_only=True, mmap=True))
    except Exception as err:  # safetensors' own SafetensorError, unpickling errors
        raise CheckpointError(f"corrupt weight file {file}: {_first_line(err)}") from err


def _read_tensor(file: Path, name: str) -> torch.Tensor:
    if file.suffix == ".safetensors":
        with require("safetensors").safe_open(file, framework="pt") as f:
            return f.get_tensor(name)
    return torch.load(file, map_location="cpu", weights_only=True, mmap=True)[name].clone()


def _restore_parameter(model: nn.Module, entry: Mapping[str, Any], stored: Mapping[str, Path]) -> None:
    """Give ``model`` the parameter ``entry["name"]`` that its class lacks, with the stored values."""
    owner_path, _, attr = entry["name"].rpartition(".")
    try:
        owner = model.get_submodule(owner_path)
    except AttributeError as err:
        raise CheckpointError(f"{type(model).__name__} has no module {owner_path!r} to hold {entry['name']}") from err
    value = _read_tensor(stored[entry["name"]], entry["name"])
    if list(value.shape) != entry["shape"]:
        raise CheckpointError(f"{entry['name']}: the report says shape {entry['shape']}, the weights hold "
                              f"{list(value.shape)}")
    like = next(model.parameters())
    owner.register_parameter(attr, nn.Parameter(value.to(device=like.device, dtype=like.dtype)))


def _check_every_parameter_stored(model: nn.Module, stored: Mapping[str, Path], path: Path) -> None:
    """CheckpointError when a parameter of ``model`` (under none of its tied names) is not in the weights."""
    from .streaming import _aliases

    missing = sorted({names[0] for names in map(sorted, _aliases(model).values()) if not any(n in stored for n in names)})
    if missing:
        raise CheckpointError(f"the weights in {path} lack {len(missing)} tensor(s) the model needs: "
                              f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} (stock transformers "
                              "would initialise them at random)")


def swap_in_rmsnorm(model: nn.Module, entry: Mapping[str, Any]) -> None:
    """Replace the LayerNorm at ``entry["path"]`` by an RMSNorm holding the parameters the entry keeps."""
    parent_path, _, attr = entry["path"].rpartition(".")
    parent = model.get_submodule(parent_path)
    old = getattr(parent, attr)
    weight, bias = getattr(old, "weight", None), getattr(old, "bias", None)
    keep_w, keep_b = bool(entry["weight"]), bool(entry["bias"])
    new = RMSNorm(entry["normalized_shape"], eps=entry["eps"], elementwise_affine=keep_w or keep_b, bias=keep_b,
                  device=weight.device if weight is not None else None,
                  dtype=weight.dtype if weight is not None else None)
    with torch.no_grad():
        if new.weight is not None:
            new.weight.copy_(weight if keep_w else torch.ones_like(new.weight))
        if new.bias is not None:
            new.bias.copy_(bias)
    setattr(parent, attr, new)


# ------------------------------------------------------------------------------ stock-compatible plans

def stock_constraints(model, stored_dtype: torch.dtype, *, fold_affine: bool = True):
    """The planning constraints of a folder that stock transformers loads, saved in ``stored_dtype``:
    no precompute (every norm module stays), no parameter the architecture lacks (e.g. GPT-2's
    ``lm_head.bias``: folding ln_f's β into the head would write it, stock drops it; ln_f keeps γ/β),
    and merged BatchNorms kept as exact identities (the architecture loads their keys)."""
    return PlanConstraints.for_stock_checkpoint(stock_parameter_shapes(model.config, type(model)), stored_dtype,
                                                fold_affine=fold_affine)
