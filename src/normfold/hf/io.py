"""Hugging Face folders in and out: offline loading, example inputs, atomic saving, reloading.

A folded folder is a plain ``save_pretrained`` folder that stock transformers loads: every norm
the fold turned into an RMSNorm keeps its LayerNorm keys (explicit ones / zeros where the affine
part was folded away), and an LN on a zero-mean input computes exactly the RMSNorm. The list of
swapped norms lives in ``normfold_report.json`` under ``"swapped"``, so
:func:`from_pretrained` can put the fast :class:`normfold.nn.RMSNorm` modules back.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn

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
            cls = auto._model_mapping[type(config)]
        except (KeyError, ValueError):
            continue
        if arch is None or cls.__name__ == arch:
            return auto if trust_remote_code else cls
    if trust_remote_code:
        return transformers.AutoModel
    try:
        return transformers.AutoModel._model_mapping[type(config)]
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
    except (OSError, ValueError, RuntimeError, KeyError) as err:
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
    """Keyword inputs for one forward pass, built from the config: token ids (+ attention mask,
    decoder ids, ``use_cache=False``) for text models, pixel values for vision models.

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
        size = getattr(config, "image_size", 224)
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        inputs["pixel_values"] = torch.randn(batch, getattr(config, "num_channels", 3), h, w, generator=gen)  # (B, C, H, W)
    elif "input_ids" in params:
        text = getattr(config, "get_text_config", lambda: config)()
        max_len = min(v for v in (getattr(text, "max_position_embeddings", None), getattr(text, "n_positions", None), seq) if v)
        ids = torch.randint(0, text.vocab_size, (batch, max_len), generator=gen)  # (B, T)
        inputs["input_ids"] = ids
        if "attention_mask" in params:
            inputs["attention_mask"] = torch.ones_like(ids)
        if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
            inputs["decoder_input_ids"] = ids.clone()
    else:
        raise CheckpointError(f"cannot build example inputs for {type(config).__name__}: its forward takes neither input_ids nor pixel_values")
    if "use_cache" in params:
        inputs["use_cache"] = False  # no KV cache objects in the captured graph
    return inputs


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

@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike, *, overwrite: bool = False,
                      protect: tuple[Path, ...] = ()) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``out_dir``; rename it to ``out_dir`` on success.

    On any exception (or Ctrl-C) the temporary folder is removed and ``out_dir`` is untouched.
    ``protect``: folders that must never be replaced (the input model).
    """
    out = Path(out_dir).absolute()
    for p in protect:
        p = Path(p).resolve()
        if out.resolve() == p or p in out.resolve().parents:
            raise CheckpointError(f"refusing to write into the input model folder {p}: pick another -o")
    if out.exists() and not overwrite:
        raise CheckpointError(f"output folder exists: {out} (pass --overwrite to replace it)")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"output path exists and is not a folder: {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.normfold-tmp-", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():  # overwrite: move the old folder aside first so there is never a half state
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.normfold-old-", dir=out.parent))
        os.replace(out, old / "x")
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


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
    LN(x)·1 + 0 on a zero-mean x is exactly the weightless RMSNorm.
    """
    stock_keys = stock_parameter_shapes(folded.config, type(folded))
    state = {k: v for k, v in folded.state_dict().items()}
    norms = {s["path"]: s for s in swapped_norms(folded)}
    for key, shape in stock_keys.items():
        if key in state:
            continue
        path, _, leaf = key.rpartition(".")
        if path in norms and leaf in ("weight", "bias"):
            fill = torch.ones if leaf == "weight" else torch.zeros
            state[key] = fill(shape, dtype=dtype or torch.float32)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    # save_pretrained shares storage between tied tensors; untied ones must not alias
    return {k: v.contiguous() for k, v in state.items()}


def stock_parameter_shapes(config, cls: type) -> dict[str, torch.Size]:
    """State-dict keys and shapes of the stock model for ``config`` (built on the meta device: no memory)."""
    with torch.device("meta"):
        stock = cls._from_config(config)
    return {k: v.shape for k, v in stock.state_dict().items()}


def untie_config(model: nn.Module) -> None:
    """Set ``tie_word_embeddings=False`` when the fold gave the output embedding its own tensor."""
    config = model.config
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return
    emb_in, emb_out = get_in(), get_out()
    if emb_in is None or emb_out is None:
        return
    if emb_in.weight is not emb_out.weight and getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False
        text = getattr(config, "get_text_config", lambda: config)()
        if text is not config:
            text.tie_word_embeddings = False


def save_folded(folded: nn.Module, out_dir: Path, *, dtype: torch.dtype | None = None) -> None:
    """``save_pretrained`` (safetensors) of the folded model in stock-loadable form, into ``out_dir``."""
    untie_config(folded)
    state = stock_state_dict(folded, dtype)
    if dtype is not None:
        folded.config.dtype = dtype
    folded.save_pretrained(out_dir, state_dict=state, safe_serialization=True)


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

    Copied: regular files inside ``source_dir``. Skipped and returned as ``[{"path", "reason"}]``:
    links (even to files inside: ``README.md -> ../secret.txt`` must not publish the secret), devices
    and pipes, hidden folders (``.git``), weight files in subfolders. Skipped silently: the top-level
    weights and what the fold writes itself (``config.json``, ``*.index.json``, ``normfold_*``); a
    file already in ``out_dir`` is the fold's own and is kept. Every folder and file is opened relative
    to its parent's descriptor without following links, so a link swapped in meanwhile is refused too,
    and nothing is written outside ``out_dir``.
    """
    skipped: list[dict[str, str]] = []
    pipeline = _pipeline_module_folders(Path(source_dir))
    src_fd = os.open(source_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        dst_fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            _copy_folder(src_fd, dst_fd, "", pipeline, skipped)
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)
    return skipped


def _pipeline_module_folders(source: Path) -> set[str]:
    """The folders of a sentence-transformers pipeline (``modules.json``: ``1_Pooling``, ``2_Dense``, ...)."""
    modules_file = source / "modules.json"
    if modules_file.is_symlink() or not modules_file.is_file():
        return set()
    try:
        paths = {m["path"] for m in json.loads(modules_file.read_text())}
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError):
        return set()  # not a pipeline normfold can read: carried over as a plain file
    return {p for p in paths if isinstance(p, str) and p and os.sep not in p and "/" not in p and p not in (".", "..")}


def _copy_folder(src_fd: int, dst_fd: int, rel: str, pipeline: set[str], skipped: list[dict[str, str]],
                 keep_weights: bool = False) -> int:
    """Copy the folder at ``src_fd`` into the one at ``dst_fd`` by :func:`copy_side_files`' rules;
    ``rel`` is its path in the source (``""`` at the top). Returns the number of files copied."""
    copied = 0
    with os.scandir(src_fd) as entries:
        names = sorted(entry.name for entry in entries)
    for name in names:
        path = f"{rel}{name}"
        mode = os.stat(name, dir_fd=src_fd, follow_symlinks=False).st_mode
        if stat.S_ISLNK(mode):
            skipped.append({"path": path, "reason": "symbolic link, not followed"})
        elif stat.S_ISDIR(mode):
            if name.startswith("."):
                skipped.append({"path": path + "/", "reason": "hidden folder"})
                continue
            copied += _copy_subfolder(src_fd, dst_fd, name, f"{path}/", pipeline, skipped,
                                      keep_weights or (not rel and name in pipeline))
        elif not stat.S_ISREG(mode):
            skipped.append({"path": path, "reason": "not a regular file"})
        elif not rel and (name == "config.json" or name.endswith(".index.json") or name.startswith("normfold_")):
            continue  # written by the fold itself
        elif name.endswith(WEIGHT_SUFFIXES) and not keep_weights:
            if rel:
                skipped.append({"path": path, "reason": "weight file of the unfolded model"})
        else:
            copied += _copy_file(src_fd, dst_fd, name, path, skipped)
    return copied


def _copy_subfolder(src_fd: int, dst_fd: int, name: str, rel: str, pipeline: set[str],
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
            copied = _copy_folder(sub_src, sub_dst, rel, pipeline, skipped, keep_weights)
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


def _copy_file(src_fd: int, dst_fd: int, name: str, path: str, skipped: list[dict[str, str]]) -> int:
    """Copy regular file ``name`` (1) unless it is no longer one, or ``out`` already has it (0)."""
    try:  # O_NONBLOCK: a pipe swapped in since the listing must not block the open
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=src_fd)
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
    """Load a folder written by ``normfold fold`` and swap in :class:`normfold.nn.RMSNorm` where
    the fold did (the ``"swapped"`` list of ``normfold_report.json``), approximate replacements
    (``--approximate``, marked ``"approximate": true``) included: stock transformers would load
    those as LayerNorms, which is a different model."""
    path = check_model_dir(path)
    report_file = path / REPORT_JSON
    if not report_file.is_file():
        raise CheckpointError(f"no {REPORT_JSON} in {path}: not a folder written by `normfold fold`")
    try:
        swapped = json.loads(report_file.read_text())["swapped"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{report_file} is not a normfold report: {_first_line(err)}") from err
    model = load_model(path, dtype=dtype, trust_remote_code=trust_remote_code)
    for entry in swapped:
        swap_in_rmsnorm(model, entry)
    return model


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

def stock_compatible_plan(plan, stock_keys: set[str]):
    """The plan, minus affine folds that would create a bias the stock architecture cannot load.

    E.g. GPT-2's ``lm_head`` has no bias: folding ln_f's β into it would write ``lm_head.bias``,
    which stock transformers drops. Such a norm keeps its γ/β (an RMSNorm with affine) instead;
    its other consumers keep their weights too, since γ/β can only move all at once.
    Returns ``(new_plan, {norm path: why its affine was kept})``.
    """
    from dataclasses import replace

    from ..fold.plan import FoldPlan

    kept = {s.norm_path: f"affine kept: the stock architecture has no {s.bias_fqn}"
            for s in plan.affine_fold if s.create_bias and s.bias_fqn not in stock_keys}
    if not kept:
        return plan, kept
    betas = {s.norm_path: s.beta_fqn is not None for s in plan.affine_fold}
    gammas = {s.norm_path: s.gamma_fqn is not None for s in plan.affine_fold}
    swap = [replace(s, elementwise_affine=gammas[s.path] or betas[s.path], bias=betas[s.path]) if s.path in kept else s
            for s in plan.swap]
    return FoldPlan(center=list(plan.center), untie=list(plan.untie),
                    affine_fold=[s for s in plan.affine_fold if s.norm_path not in kept], swap=swap), kept
