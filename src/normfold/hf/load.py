"""Loading a Hugging Face folder offline: the folder and weight-file checks, its config, the model
class that builds it, the model itself. :class:`CheckpointError` (``normfold.hf.errors``) is the
user error every part of ``normfold.hf`` raises for a folder it cannot read or write."""
from __future__ import annotations

import json
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._deps import require
from .._text import first_line
from .errors import CheckpointError
from .normfold_only import REAL_MODEL_TYPE_KEY, is_normfold_only, real_model_type
from .weight_files import weight_source


def default_model_path() -> Path:
    """The bundled trained byte-level GPT-2 (see its README.md)."""
    return Path(str(resources.files("normfold") / "data" / "default_model"))


# what a Hugging Face model id looks like: "name" or "org/name" (letters, digits, "-", "_", "."), never a path
_MODEL_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


# files of other frameworks a hub repo often holds beside the PyTorch weights (GPT-2's: several GB): not fetched
_OTHER_FRAMEWORKS = ("*.h5", "*.msgpack", "*.onnx", "*.onnx_data", "*.ot", "*.tflite", "*.mlmodel", "onnx/*",
                     "coreml/*", "flax_model*", "tf_model*", "rust_model*")


def resolve_model(name: str | os.PathLike, revision: str | None = None) -> Path:
    """A model folder, or a Hugging Face model id (``org/name``) resolved to its snapshot in the hub cache
    by ``huggingface_hub.snapshot_download``: downloaded at ``revision`` (default ``main``) unless cached,
    the cache and ``HF_HUB_OFFLINE`` honoured as transformers honours them. An existing folder wins over
    an id of the same spelling; a name that cannot be an id is returned as a path (checked where it
    is read: :func:`check_model_dir`). CheckpointError in one line naming the id when it cannot be
    fetched, or for a ``revision`` given with a folder (a folder has no revisions)."""
    path = Path(name)
    if path.exists() or not _MODEL_ID.fullmatch(str(name)):
        if revision is not None:
            raise CheckpointError(f"a revision ({revision!r}) applies to a hub model id, not to the folder {path}")
        return path
    hub = require("huggingface_hub")
    offline = hub.is_offline_mode()
    try:
        folder = hub.snapshot_download(str(name), revision=revision, ignore_patterns=list(_OTHER_FRAMEWORKS))
    except (OSError, ValueError) as err:  # not cached offline, no such repo or revision, no network, a bad id
        where = "in the hub cache (offline)" if offline else "on the hub or in its cache"
        at = "" if revision is None else f" at revision {revision!r}"
        raise CheckpointError(f"model {str(name)!r}{at} is neither a folder nor {where}: {first_line(err)}") from err
    return check_model_dir(folder)


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


def load_config(model_dir: str | os.PathLike, *, trust_remote_code: bool = False, normfold_only: bool = False):
    """The folder's config. A folder only normfold loads correctly (:mod:`normfold.hf.normfold_only`) is
    refused unless ``normfold_only`` (``normfold.from_pretrained`` and the checks of such folders): then
    its real model type is restored and the config names the weights normfold stored."""
    transformers = require("transformers")
    path = check_model_dir(model_dir)
    raw = _config_json(path)
    if is_normfold_only(raw):
        if not normfold_only:
            raise CheckpointError(f"{path} was written by normfold for normfold.from_pretrained only (rotated, sliced, "
                                  "approximate, or holding parameters its class lacks): load it with "
                                  "normfold.from_pretrained")
        fields = {k: v for k, v in raw.items() if k not in ("model_type", REAL_MODEL_TYPE_KEY)}
        try:
            config = transformers.AutoConfig.for_model(real_model_type(raw, path / "config.json"), **fields)
        except (ValueError, KeyError, TypeError, *_validation_errors()) as err:
            raise CheckpointError(f"unsupported or unreadable config in {path}: {_config_error(err)}") from err
        config.transformers_weights = weight_source(path).entry  # what transformers then loads
        return config
    try:
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError, json.JSONDecodeError, *_validation_errors()) as err:
        raise CheckpointError(f"unsupported or unreadable config in {path}: {_config_error(err)}") from err


def _validation_errors() -> tuple[type[Exception], ...]:
    """The errors of a config that its class's validators reject (huggingface_hub's strict dataclasses,
    which transformers' configs are; not ValueErrors): () with a huggingface_hub that has none."""
    errors = require("huggingface_hub").errors
    return tuple(e for e in (getattr(errors, "StrictDataclassError", None),) if e is not None)


def _config_error(err: BaseException) -> str:
    """A config error in one line: its own first line, and its cause's where that line only names a
    validator ("Class validation error for validator 'validate_layer_type':")."""
    line = first_line(err)
    cause = err.__cause__
    return f"{line} {type(cause).__name__}: {first_line(cause)}" if line.endswith(":") and cause else line


def _config_json(path: Path) -> dict[str, Any]:
    """``config.json`` as a dict; CheckpointError when it is not a readable JSON object."""
    return read_json_object(path / "config.json", "a readable JSON config")


def read_json_object(file: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``file``; CheckpointError saying ``file`` is not ``what`` when it cannot be
    read or parsed, or holds something else than an object."""
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{file} is not {what}: {first_line(err)}") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def model_class_for(config, *, trust_remote_code: bool = False) -> type:
    """The class that builds ``config.architectures[0]`` (the head the folder was saved with): from the
    Auto mappings, else transformers' class of that name when ``config`` is its config (a CTC, depth or
    detection head, a tower of a composite model), else the bare backbone AutoModel maps ``config`` to.
    With ``trust_remote_code``, the Auto class that resolves the folder's own code.
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
    named = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if (isinstance(named, type) and issubclass(named, transformers.PreTrainedModel)
            and isinstance(config, named.config_class)):  # a head no Auto class above maps: Wav2Vec2ForCTC
        return named
    try:
        mapped = transformers.AutoModel._model_mapping[type(config)]
        return mapped[0] if isinstance(mapped, tuple) else mapped
    except (KeyError, ValueError) as err:
        raise CheckpointError(f"unsupported architecture {arch or config.model_type!r}: transformers has no model class for it") from err


def load_model(model_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
               trust_remote_code: bool = False, ignore_mismatched_sizes: bool = False) -> nn.Module:
    """Load a folder offline (``local_files_only``) in ``dtype``, eval mode, eager attention.

    Eager attention because ``torch.export`` + decompositions fail on SDPA for some models.
    ``ignore_mismatched_sizes``: tensors whose shape differs from the config's are left initialised
    (``normfold.from_pretrained`` then loads a sliced folder's resized tensors itself). A folder holding
    weights the class does not take is refused: what normfold writes from the model would lose them.
    """
    model, info = load_model_and_info(model_dir, dtype=dtype, trust_remote_code=trust_remote_code,
                                      ignore_mismatched_sizes=ignore_mismatched_sizes)
    untaken = sorted(info.get("unexpected_keys") or ())
    if untaken:
        shown = ", ".join(untaken[:3]) + (f" and {len(untaken) - 3} more" if len(untaken) > 3 else "")
        counted = f"{len(untaken)} tensors" if len(untaken) > 1 else "1 tensor"
        raise CheckpointError(f"{model_dir} holds {counted} that {type(model).__name__} does not take "
                              f"({shown}): a folder written from it would lose them; config.json's architectures "
                              "should name the class that takes them")
    return model


def load_model_and_info(model_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                        trust_remote_code: bool = False, ignore_mismatched_sizes: bool = False,
                        quiet: bool = False, normfold_only: bool = False) -> tuple[nn.Module, dict[str, Any]]:
    """:func:`load_model`, and what transformers says of the load, under the model's own names (after
    the key renaming it applies on load: GPT-NeoX's ``embed_out`` is ``lm_head``, legacy ``gamma`` is
    ``weight``): ``missing_keys`` (left initialised at random), ``unexpected_keys`` (in the weights,
    taken by no parameter), ``mismatched_keys`` ((name, stored shape, model shape)). ``quiet``: without
    transformers' own load report (the caller judges the load itself). ``normfold_only``: see
    :func:`load_config`."""
    transformers = require("transformers")
    path = check_model_dir(model_dir)
    config = load_config(path, trust_remote_code=trust_remote_code, normfold_only=normfold_only)
    cls = model_class_for(config, trust_remote_code=trust_remote_code)
    _check_weight_files(path)
    logging, verbosity = transformers.utils.logging, transformers.utils.logging.get_verbosity()
    if quiet:
        logging.set_verbosity_error()
    try:
        model, info = cls.from_pretrained(path, config=config, local_files_only=True, trust_remote_code=trust_remote_code,
                                          dtype=dtype, attn_implementation="eager", output_loading_info=True,
                                          ignore_mismatched_sizes=ignore_mismatched_sizes)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, AttributeError, NotImplementedError) as err:
        why = first_line(err)
        if not ignore_mismatched_sizes and "ignore_mismatched_sizes" in str(err):  # its report went to the log
            why = _mismatched_shapes(cls, path, config, trust_remote_code) or why
        raise CheckpointError(f"could not load the weights in {path}: {why}") from err
    finally:
        logging.set_verbosity(verbosity)
    return model.eval(), info


def _mismatched_shapes(cls: type, path: Path, config, trust_remote_code: bool) -> str | None:
    """The tensors stored in another shape than the model built from ``config`` has (what transformers' load
    report lists before it raises, in words for the one-line error), None when they cannot be told."""
    try:
        _, info = cls.from_pretrained(path, config=config, local_files_only=True, trust_remote_code=trust_remote_code,
                                      attn_implementation="eager", output_loading_info=True,
                                      ignore_mismatched_sizes=True)
    except Exception:  # noqa: BLE001  the first error stands
        return None
    wrong = sorted(info.get("mismatched_keys") or ())
    if not wrong:
        return None
    shown = ", ".join(f"{name} stored {list(stored)}, model {list(built)}" for name, stored, built in wrong[:3])
    more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
    counted = f"{len(wrong)} tensors are" if len(wrong) > 1 else "1 tensor is"
    return (f"{counted} stored in other shapes than the model config.json builds ({shown}{more}): "
            "the config does not describe these weights")


def _check_weight_files(path: Path) -> None:
    """Refuse weights that would need pickle, and detect corrupt safetensors early, in the files
    transformers will load (:func:`normfold.hf.weight_files.weight_source`): other ``.bin`` files,
    such as a Trainer's ``training_args.bin``, are never read."""
    source = weight_source(path)
    safe_open = require("safetensors").safe_open
    for name in source.files:
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{source.entry} names the weight file {name}, which {path} does not hold")
        if file.suffix == ".safetensors":
            try:
                with safe_open(file, framework="pt") as f:
                    f.keys()
            except Exception as err:  # safetensors raises its own SafetensorError for corrupt headers
                raise CheckpointError(f"corrupt safetensors file {file}: {first_line(err)}") from err
            continue
        try:  # transformers loads .bin with torch.load(weights_only=True); say so rather than trust it silently
            torch.load(file, map_location="meta", weights_only=True, mmap=True)
        except Exception as err:
            raise CheckpointError(f"{file} is not a weights-only torch checkpoint: {first_line(err)}") from err
