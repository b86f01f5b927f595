"""Compatibility table over the transformers zoo: every model type of the installed transformers that
builds offline from its default config, shrunk, and holds a LayerNorm, folded exactly (issue 16 item 6).

For each type: a tiny bare model (the size rules of tests/hf/test_zoo_folders.py), every constant
parameter randomised first (γ = 1, β = 0 and zero biases would hide a wrong affine fold), the engine's
exact fold on a 2 x 4 example (proved in float64, or in float32 where the model cannot run in float64),
then the same plan proved again on inputs of another batch size and length (3 x 7). Rows: norms,
folded, affine-folded, the error on those other inputs, each refused norm's reason, and for a model
the engine refuses, its FoldError. Any other exception is a bug and says so in the ``status`` column.
Attention is eager (the same graph on every torch version), unless the original's eager outputs hold no
finite number (transformers' eager path broken for that type): then sdpa, and the row says so.

Every row also says how the model was captured (``capture``: "whole", or "submodules: ..." when
torch.export could not capture the whole model), a FoldError's reason class (``error_class``, see
:func:`error_class`: "missing input" when the original model itself fails on the inputs, "export limit"
when it runs but torch.export cannot capture it, "normfold refusal" otherwise), and the missed folds
found by brute force (``missed``, ``missed_folds``): for each LayerNorm the engine left unfolded, the
fuzzer's oracle (tests/fuzz/centering_oracle.py) centers the parameters its input depends on and checks
numerically, in float64, whether that makes the input zero-mean and keeps every output. All the row's norms
are judged together (``judge_norms``): one run per input confirms every norm that stays not zero-mean with
all its producers centered, and only the others are searched one by one.

``--tests PATH`` (issue 33 item 5): configs and inputs from transformers' own ModelTesters, read from a
checkout of its test suite (benchmarks/hf_testers.py; the suite is not on PyPI), for the bare model and
the main head class of each type; a type whose tester cannot be loaded is a "no tester" row with why.
Each type runs in a child process, stopped past ``--max-rss-gb``.

    python benchmarks/hf_zoo.py                         # every type: benchmarks/results/hf_zoo.{csv,md}
    python benchmarks/hf_zoo.py --types bert gpt2 vit   # some types only
    python benchmarks/hf_zoo.py --before benchmarks/results/hf_zoo.csv --reached-only --out /tmp/after
        # only the types the earlier table reached with a LayerNorm or a FoldError, each row with the
        # earlier folded count (``folded_before``) and a summary of the types whose count rose or fell
    python benchmarks/hf_zoo.py --tests /tmp/transformers-tests --types led vits --out /tmp/zoo_testers
        # transformers' ModelTesters (a checkout's tests/models/<name>/test_modeling_<name>.py)
    python benchmarks/hf_zoo.py --tests /tmp/transformers-tests --shard 0/2 --out /tmp/t0   # and 1/2 at once, then
    python benchmarks/hf_zoo.py --merge /tmp/t0.csv /tmp/t1.csv --out benchmarks/results/hf_zoo_testers
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import csv
import importlib.util
import inspect
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "fuzz"))  # centering_oracle: the fuzzer's brute force, as fuzz_fold.py imports it
RESULTS = REPO / "benchmarks" / "results"
OTHER_BATCH, OTHER_LENGTH = 3, 7  # the second proof's inputs: another batch size and length than the example
SECONDS_PER_TYPE = 120            # a type that takes longer to build and fold is reported as skipped
BRUTE_FORCE_SECONDS = 90          # the missed-fold brute force of one row judges no new norm after this long
                                  # (--brute-force-seconds sets it, for a slow type run on its own)
COLUMNS = ["model_type", "model_class", "status", "norms", "folded", "affine_folded", "missed", "not_judged",
           "capture", "error_class", "other_inputs_error", "compared_in", "tolerance", "seconds", "refused",
           "missed_folds", "detail"]


def _zoo_helpers():
    """tests/hf/test_zoo_folders.py: the config size rules the tests already build their zoo with."""
    return _load_by_path("_zoo_folders", REPO / "tests" / "hf" / "test_zoo_folders.py")


def _testers_module():
    """benchmarks/hf_testers.py: transformers' ModelTesters read from a checkout (``--tests``)."""
    return _load_by_path("_hf_testers", REPO / "benchmarks" / "hf_testers.py")


def _load_by_path(name: str, path: Path):
    """The module at ``path`` (not a package: this script is itself loaded by path in the tests)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class _TimeBox(BaseException):
    """The time box ran out (a BaseException: normfold turns every Exception inside a fold into a FoldError)."""


def _alarm(signum, frame):
    raise _TimeBox(f"took more than {SECONDS_PER_TYPE + BRUTE_FORCE_SECONDS:g} s")


def tiny_model(model_type: str, zoo, attention: str = "eager", **config_fields) -> nn.Module:
    """The bare model of ``model_type`` from its shrunk default config (``config_fields`` set on it
    last), with ``attention`` as its attention implementation, in eval mode, randomised."""
    config = zoo.shrunk_config(model_type)
    if hasattr(config, "num_key_value_heads") and config.num_key_value_heads is None:  # a default left unset
        config.num_key_value_heads = config.num_attention_heads  # (Nemotron's): plain multi-head attention
    for name, value in config_fields.items():
        setattr(config, name, value)
    if hasattr(config, "_attn_implementation"):
        config._attn_implementation = attention  # eager: the same graph on every torch version
    torch.manual_seed(0)
    model = zoo._bare_model_class(config)(config).eval()
    randomise_constant_parameters(model)
    return model


def randomise_constant_parameters(model: nn.Module, scale: float = 0.2, seed: int = 0) -> int:
    """Add scale·N(0, 1) noise to every floating parameter whose elements are all equal (γ = 1, β = 0, zero
    biases: the initialisations under which a wrong affine fold goes unseen); returns how many changed."""
    generator = torch.Generator().manual_seed(seed)
    changed = 0
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.numel() and bool((p == p.flatten()[0]).all()):
                p.add_(scale * torch.randn(p.shape, generator=generator).to(p.dtype))
                changed += 1
    return changed


def has_layer_norm(model: nn.Module) -> bool:
    """A LayerNorm module, or a parameter-free leaf module named like one (OLMo's ``OlmoLayerNorm``
    calls ``F.layer_norm``; the fold reads what it computes from the trace)."""
    from normfold.nn.kinds import norm_kind

    return any(norm_kind(m) == "LayerNorm" or (type(m).__name__.lower().endswith("layernorm")
                                                and not list(m.children()) and not list(m.parameters()))
               for m in model.modules())


def fold_row(model_type: str, zoo) -> dict:
    """One row of the table for ``model_type`` (never raises: the status column says what happened)."""
    from normfold.hf.inputs import example_inputs_for

    row = dict.fromkeys(COLUMNS, "")
    row["model_type"] = model_type
    with _time_box(row):
        try:
            model = tiny_model(model_type, zoo)
            example = example_inputs_for(model)
            attention_note = ""
            if computes_nothing_finite(model, example):
                model = tiny_model(model_type, zoo, attention="sdpa")
                attention_note = EAGER_NAN_NOTE
            other = example_inputs_for(model, batch=OTHER_BATCH, seq=OTHER_LENGTH, seed=1)
        except _TimeBox:
            raise
        except Exception as err:  # noqa: BLE001  the shrunk default config builds no model: skipped, with why
            return {**row, "status": "skipped", "detail": f"no tiny model: {type(err).__name__}: {_line(err)}"}
        fold_and_prove(row, model, example, other)
        row["detail"] = "; ".join(part for part in (attention_note, row["detail"]) if part)
    return row


EAGER_NAN_NOTE = ("eager attention: no finite output from the original (transformers' eager path, e.g. a float "
                  "additive mask read as a boolean one: every score -inf), measured with sdpa attention")


def computes_nothing_finite(model: nn.Module, inputs: dict) -> bool:
    """Whether ``model`` runs eagerly on ``inputs`` and every floating element of its outputs is NaN or
    ±inf (a model that raises is judged by the fold, which says why)."""
    from normfold.engine.verify import flatten_outputs

    try:
        with torch.no_grad():
            leaves = flatten_outputs(model(**inputs))
    except Exception:  # noqa: BLE001  the fold's own run reports it
        return False
    floats = [t for _, t in leaves if torch.is_tensor(t) and t.is_floating_point() and t.numel()]
    return bool(floats) and not any(torch.isfinite(t).any() for t in floats)


@contextlib.contextmanager
def _time_box(row: dict):
    """Run a row's work within SECONDS_PER_TYPE (else status "skipped"), any exception other than a
    FoldError an "EXCEPTION" row (a bug of normfold: the table must show it, not stop); sets ``seconds``."""
    start = time.perf_counter()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(int(SECONDS_PER_TYPE + BRUTE_FORCE_SECONDS))
    try:
        yield
    except _TimeBox as err:
        row.update(status="skipped", detail=str(err))
    except Exception as err:  # noqa: BLE001  a bug of normfold: the table must show it, not stop
        row.update(status="EXCEPTION", detail=f"{type(err).__name__}: {_line(err)}")
    finally:
        signal.alarm(0)
        row["seconds"] = f"{time.perf_counter() - start:.1f}"


def fold_and_prove(row: dict, model: nn.Module, example: dict, other: dict) -> None:
    """Fill ``row`` for ``model``: fold on ``example``, prove the plan again on ``other``, the capture
    route, a FoldError's reason class, and the brute force over the norms left unfolded."""
    from normfold.engine import FoldError, fold
    from normfold.engine.pipeline import apply_fold, prove_fold

    row["model_class"] = type(model).__name__
    if not has_layer_norm(model):
        row["status"] = "no LayerNorm"
        return
    try:
        _, report = fold(model, example)
        norms = [n for n in report.norms if n.kind == "LayerNorm"]
        if not norms:
            row.update(_unreached_layer_norms(model, example))
            return
        row.update(norms=len(norms), folded=sum(n.foldable for n in norms),
                   affine_folded=sum(n.affine_folded for n in norms), capture=capture_route(report))
        row["refused"] = _reasons(norms)
        proof = prove_fold(model, apply_fold(model, report.plan), other, report.plan)
        row.update(other_inputs_error=f"{proof.max_rel_error:.1e}", compared_in=proof.compared_in,
                   tolerance=f"{proof.tolerance:.1e}")
        row["status"] = "proved" if proof.ok else "WRONG"
        row["detail"] = proof.fallback or (proof.why or "")
        judged_in = torch.float64 if proof.compared_in == "float64" else torch.float32
        row.update(missed_folds(model, [n for n in norms if not n.foldable], [example, other], judged_in))
    except FoldError as err:
        row.update(status="FoldError", detail=_line(err), error_class=error_class(_line(err), eager_error(model, example),
                                                                           row.get("model_type")))


def _unreached_layer_norms(model: nn.Module, example: dict) -> dict:
    """The row of a model whose fold saw no LayerNorm: "no LayerNorm" when none of its modules is one (a
    module named like one computes something else), else "LayerNorm not reached": the example call (CSM,
    Molmo2, GLM-Image: their text alone, every media layout rejected) runs none of them, so nothing of
    them is measured."""
    from normfold.nn.kinds import norm_kind

    paths = [name for name, m in model.named_modules() if norm_kind(m) == "LayerNorm"]
    if not paths:
        return {"status": "no LayerNorm"}
    return {"status": "LayerNorm not reached", "detail": f"the example call ({', '.join(sorted(example))}) runs "
            f"none of its {len(paths)} LayerNorm modules ({paths[0]}, ...): not measured"}


def capture_route(report) -> str:
    """"whole", or "submodules: a, b" when torch.export could not capture the whole model."""
    return f"submodules: {', '.join(report.captured_through)}" if report.captured_through else "whole"


EXPORT_LIMIT_MARKERS = ("torch.export could not capture", "GuardOnDataDependentSymNode", "data-dependent",
                        "Could not extract specialized integer", "Could not guard on data-dependent")


# model types whose forward fails in transformers' own code for every valid call of the kind the zoo makes, with
# the error it raises there (matched, so that another error is still "missing input") and where the bug is
TRANSFORMERS_BUGS = {
    "llama4": ("object has no attribute 'image_outputs'",
               "modeling_llama4.py: Llama4ForConditionalGeneration.forward reads outputs.image_outputs from its "
               "language model's MoeCausalLMOutputWithPast, which has none (every call with return_dict=True)"),
    "tvp": ("is invalid for input of size",
            "modeling_tvp.py: add_2d_positional_embeddings views the (width, hidden) column table as "
            "(batch_size, 1, width, hidden): every batch of more than one video fails"),
}


ORIGINAL_JUMPS_MARKER = "the original's own output there moves by"  # VerifyResult.failure(): the original jumps there


def error_class(message: str, eager: str | None, model_type: str | None = None) -> str:
    """The reason class of a FoldError (``message``: its first line, which says which step failed and why;
    a later line may quote a capture route), given ``eager``, the original model's own error on the same
    inputs run eagerly (None when it runs):

    - "transformers bug": the original fails in transformers' own code with the error
      :data:`TRANSFORMERS_BUGS` records for ``model_type``, as it does for every valid call;
    - "missing input": the original model itself fails on the inputs otherwise (``eager`` is set): the
      example was wrong, not the fold;
    - "export limit": it runs eagerly, and the message is torch.export's (data-dependent control flow,
      an object export does not trace): export cannot capture it, and no submodule route saved it;
    - "the original jumps": the proof failed where the original's own output moves past the tolerance when its
      weights move by one unit in the last place (a top-k over tied scores: DETR-style query selection), so no
      transform of it can be proved on these inputs;
    - "normfold refusal": it runs and export captured it: normfold itself refused (an analysis or
      planning error, a failed or impossible proof, an overflow)."""
    bug = TRANSFORMERS_BUGS.get(model_type)
    if eager is not None and bug is not None and bug[0] in eager:
        return f"transformers bug ({bug[1]})"
    if eager is not None:
        return f"missing input ({eager})"
    if any(marker in message for marker in EXPORT_LIMIT_MARKERS):
        return "export limit"
    if ORIGINAL_JUMPS_MARKER in message:
        return "the original jumps"
    return "normfold refusal"


def eager_error(model: nn.Module, example: dict) -> str | None:
    """The original model's error on ``example`` run eagerly ("Type: first line"), None when it runs."""
    try:
        with torch.no_grad():
            model(**example)
    except Exception as err:  # noqa: BLE001  the model's own code: whatever it raises is the answer
        return f"{type(err).__name__}: {_line(err)[:150]}"
    return None


def missed_folds(model: nn.Module, unfolded, calls: list[dict], dtype: torch.dtype = torch.float64) -> dict:
    """``missed`` (count) and ``missed_folds`` ("path: what centering folds it (engine: its reason)"; ...)
    by the fuzzer's brute-force oracle (``tests/fuzz/centering_oracle.py``) on a copy of ``model`` in
    ``dtype`` (float64; float32, at the oracle's float32 tolerances, for a model that cannot run in
    float64): for each norm in ``unfolded``, does centering its producers make its input zero-mean and
    keep every output? Norms it could not judge within BRUTE_FORCE_SECONDS are listed as not judged."""
    from centering_oracle import call_model, judge_norms

    from normfold.engine.verify import default_dtype_of

    if not unfolded:
        return {"missed": 0, "not_judged": 0, "missed_folds": ""}
    model64 = copy.deepcopy(model).to(dtype).eval()
    calls64 = [{k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in c.items()}
               for c in calls]
    norms = {n.path: n for n in unfolded}
    found, not_judged, judged = {}, {}, set()
    with default_dtype_of(model64):  # tensors its forward makes without a dtype: in float64 too
        with torch.no_grad():
            reference = [call_model(model64, c) for c in calls64]
        dims = {}
        for norm in unfolded:
            try:
                module = model64.get_submodule(norm.path)
            except AttributeError:  # a norm the engine saw inside a module path the model does not name
                not_judged[norm.path] = f"{norm.path} (no module at the path)"
                continue
            dims[norm.path] = 1 if getattr(module, "data_format", None) == "channels_first" else -1
        deadline = time.monotonic() + BRUTE_FORCE_SECONDS
        try:  # the cheap verdicts come first (one run judges many norms), then each remaining norm on its own
            for verdict in judge_norms(model64, centering_recipes(model64), dims, calls64, reference):
                judged.add(verdict.path)
                if verdict.verdict == "missed":
                    found[verdict.path] = f"{verdict.path}: {verdict.detail} (engine: {norms[verdict.path].reason})"
                elif verdict.verdict == "not judged":
                    not_judged[verdict.path] = f"{verdict.path} ({verdict.detail})"
                if time.monotonic() > deadline:
                    break
        except _TimeBox:  # the row's time box: what was found stays, the rest is not judged
            not_judged.update({p: f"{p} (time box)" for p in dims if p not in judged})
        except Exception as err:  # noqa: BLE001  a model the oracle cannot run on: its norms are not judged
            not_judged.update({p: f"{p} ({type(err).__name__})" for p in dims if p not in judged})
        not_judged.update({p: f"{p} (past {BRUTE_FORCE_SECONDS:g} s)" for p in dims if p not in judged and p not in not_judged})
    found = [found[n.path] for n in unfolded if n.path in found]
    not_judged = [not_judged[n.path] for n in unfolded if n.path in not_judged]
    judged_in = [] if dtype == torch.float64 else [f"judged in {str(dtype).removeprefix('torch.')} (the model "
                                                    "does not run in float64)"]
    text = "; ".join(judged_in + found + ([f"not judged: {', '.join(not_judged)}"] if not_judged else []))
    return {"missed": len(found), "not_judged": len(not_judged), "missed_folds": text.replace("|", "/")}


def centering_recipes(model: nn.Module) -> dict[str, tuple[int, int | None]]:
    """Each parameter's output-feature dim (and group) for the brute force: Linear and Conv weights and
    biases dim 0 (per group of a grouped conv), a transposed conv's weight dim 1, an Embedding table dim 1,
    transformers' Conv1D weight (in, out) dim 1; a norm's own γ/β none (not a linear map); any other
    parameter its last dim (added position tables, tokens). A wrong recipe can only miss a fold, never
    invent one: the oracle checks every output numerically."""
    recipes = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        if "norm" in type(module).__name__.lower():
            continue
        for name, p in module.named_parameters(recurse=False):
            if p.dim() == 0:
                continue
            groups = getattr(module, "groups", 1) if isinstance(module, nn.modules.conv._ConvNd) else 1
            if isinstance(module, nn.modules.conv._ConvTransposeNd):
                recipe = (1 if name == "weight" else 0, None)
            elif isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
                recipe = (0, p.shape[0] // groups if groups > 1 else None)
            elif isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or type(module).__name__ == "Conv1D":
                recipe = (1 if p.dim() == 2 else 0, None)
            else:
                recipe = (p.dim() - 1, None)
            recipes[f"{prefix}.{name}" if prefix else name] = recipe
    return recipes


# the task mappings a main head class is taken from, in this order (then every other, alphabetically)
HEAD_MAPPINGS = ("CAUSAL_LM", "IMAGE_TEXT_TO_TEXT", "MULTIMODAL_LM", "SEQ_TO_SEQ_CAUSAL_LM", "SPEECH_SEQ_2_SEQ",
                 "MASKED_LM", "SEQUENCE_CLASSIFICATION", "IMAGE_CLASSIFICATION", "AUDIO_CLASSIFICATION", "CTC",
                 "VIDEO_CLASSIFICATION", "TEXT_TO_WAVEFORM", "TEXT_TO_SPECTROGRAM", "OBJECT_DETECTION")


def model_classes(config, zoo, inputs: dict | None = None) -> list[type]:
    """The bare model class of ``config`` (AutoModel's) and its main head class: the first class a task
    mapping of HEAD_MAPPINGS lists for the type, then of any other mapping; with ``inputs`` (a tester's,
    made for the bare model), the first such class whose forward names every one of them when one does
    (WhisperForCausalLM names no input_features: Whisper's head is WhisperForConditionalGeneration); each once."""
    from transformers.models.auto import modeling_auto  # not at the top: transformers is optional

    classes = []
    try:
        classes.append(zoo._bare_model_class(config))
    except (KeyError, ValueError):  # a type with task heads only, or a sub-config's model (no AutoModel entry)
        named = getattr(zoo.transformers, type(config).__name__.removesuffix("Config") + "Model", None)
        if named is not None and getattr(named, "config_class", None) is type(config):  # Aimv2TextConfig: Aimv2TextModel
            classes.append(named)
    others = sorted(n[len("MODEL_FOR_"):-len("_MAPPING_NAMES")] for n in dir(modeling_auto)
                    if n.startswith("MODEL_FOR_") and n.endswith("_MAPPING_NAMES"))
    heads = []
    for task in [*HEAD_MAPPINGS, *(t for t in others if t not in HEAD_MAPPINGS)]:
        name = getattr(modeling_auto, f"MODEL_FOR_{task}_MAPPING_NAMES", {}).get(config.model_type)
        name = name[0] if isinstance(name, (list, tuple)) else name
        head = getattr(zoo.transformers, name, None) if name else None
        if head is not None:
            heads.append(head)
    fitting = [h for h in heads if inputs is not None and set(inputs) <= set(inspect.signature(h.forward).parameters)]
    head = (fitting or heads or [None])[0]
    if head is not None and head not in classes:
        classes.append(head)
    return classes


def tester_rows(model_type: str, root: Path, zoo, testers) -> list[dict]:
    """The rows of ``model_type`` with transformers' own tester config and inputs (``hf_testers``): its
    bare model and its main head class, each folded on the tester's inputs (those it makes for that class where
    the class rejects the common ones) and proved again on the tester's inputs of another seed; one "no tester" row
    (with why) when its tester cannot be loaded; a class outside the test file's ``all_model_classes`` that
    rejects the inputs is skipped (they were made for another class), not a FoldError."""
    row = dict.fromkeys(COLUMNS, "")
    row["model_type"] = model_type
    try:
        config, example, tester = testers.tester_inputs(model_type, root, seed=0)
        other = testers.tester_inputs(model_type, root, seed=1)[1]
    except Exception as err:  # noqa: BLE001  TesterError, or the suite's code failing on this checkout
        return [{**row, "status": "no tester", "detail": f"{type(err).__name__}: {_line(err)}"}]
    classes = model_classes(config, zoo, example)
    if not classes:
        return [{**row, "status": "skipped", "detail": f"{tester}; no model class takes {type(config).__name__}"}]
    tested = testers.tested_classes(model_type, root)
    rows = []
    for cls in classes:
        rows.append({**row, "model_class": cls.__name__, "detail": tester})
        with _time_box(rows[-1]):
            try:
                model = tester_model(cls, config)
            except _TimeBox:
                raise
            except Exception as err:  # noqa: BLE001  the tester's config builds no such model: skipped, with why
                rows[-1].update(status="skipped", detail=f"no model: {type(err).__name__}: {_line(err)}")
                continue
            inputs, other_inputs, rejected = _class_inputs(model, model_type, root, testers, example, other)
            if rejected is not None and tested and cls.__name__ not in tested and has_layer_norm(model):
                # inputs made for another class (PI0Model gets PI0ForConditionalGeneration's)
                rows[-1].update(status="skipped", detail=f"{tester}; its inputs are for {', '.join(sorted(tested))} "
                                f"(the test file's all_model_classes), and {cls.__name__} rejects them: {rejected}")
                continue
            fold_and_prove(rows[-1], model, accepted_inputs(model, inputs), accepted_inputs(model, other_inputs))
            rows[-1]["detail"] = f"{tester}; {rows[-1]['detail']}".rstrip("; ")
    return rows


def _class_inputs(model: nn.Module, model_type: str, root: Path, testers, example: dict, other: dict) -> tuple:
    """(example, other, the model's error on that example or None): the tester's common inputs, or, where
    ``model`` rejects them and the tester makes inputs per class (Perceiver: ids for its masked LM, floats for its
    bare model), those it makes for this class (the common ones again, where it makes none)."""
    error = eager_error(model, accepted_inputs(model, example))
    if error is None:
        return example, other, None
    try:
        mine, my_other = (testers.tester_inputs(model_type, root, seed=seed, model_class=type(model))[1]
                          for seed in (0, 1))
    except Exception:  # noqa: BLE001  the suite's code on a partial checkout: the common inputs stand
        return example, other, error
    return mine, my_other, eager_error(model, accepted_inputs(model, mine))


def tester_model(cls: type, config) -> nn.Module:
    """``cls`` on a copy of a tester's config, eager attention and no cache (as normfold's own example
    inputs ask: a cache object is no output to compare), in eval mode, randomised."""
    config = copy.deepcopy(config)
    for part in {id(c): c for c in (config, config.get_text_config(), config.get_text_config(decoder=True))}.values():
        if getattr(part, "use_cache", None):
            part.use_cache = False
    if hasattr(config, "_attn_implementation"):
        config._attn_implementation = "eager"  # the same graph on every torch version
    torch.manual_seed(0)
    model = cls(config).eval()
    randomise_constant_parameters(model)
    return model


def accepted_inputs(model: nn.Module, inputs: dict) -> dict:
    """``inputs`` less those ``model.forward`` does not name (all of them when it takes ``**kwargs``)."""
    parameters = inspect.signature(model.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(inputs)
    return {k: v for k, v in inputs.items() if k in parameters}


def _line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:300].replace("|", "/")


def _reasons(norms) -> str:
    """Each distinct refusal reason (where it happened left out) with how many norms it refused, most
    frequent first."""
    counts = collections.Counter(re.sub(r" at [\w.\[\]]+", "", n.reason.split("; affine kept")[0])
                                 for n in norms if not n.foldable)
    return "; ".join(f"{count}x {reason}" for reason, count in counts.most_common()).replace("|", "/")


def model_types(zoo, wanted: list[str] | None) -> list[str]:
    """The types to try: ``wanted``, or the tests' zoo first, then every other type of CONFIG_MAPPING."""
    if wanted:
        return wanted
    every = sorted(zoo.transformers.CONFIG_MAPPING.keys())
    return list(zoo.MODEL_TYPES) + [t for t in every if t not in zoo.MODEL_TYPES]


REACHED = ("proved", "FoldError", "WRONG", "EXCEPTION", "LayerNorm not reached")  # types a fold was tried on


def read_table(path: str | Path) -> dict[str, dict]:
    """An earlier table's rows (``--out``'s CSV) by model type."""
    with open(path, newline="") as handle:
        return {row["model_type"]: row for row in csv.DictReader(handle)}


def reached_types(before: dict[str, dict]) -> list[str]:
    """The types an earlier table reached with a LayerNorm or a FoldError, in its order: the ones whose
    folded count a change of the engine can move (no-LayerNorm and skipped types are left out)."""
    return [t for t, row in before.items() if row["status"] in REACHED]


def folded_before(row: dict, before: dict[str, dict]) -> str:
    """The earlier table's folded count for this row's type, or its status where it had no count."""
    old = before.get(row["model_type"])
    if old is None:
        return "not in before"
    return old["folded"] if old["folded"] != "" else old["status"]


def folded_changes(rows: list[dict]) -> tuple[list[str], list[str], list[str]]:
    """"type: before → after" for the types whose folded count rose, for those where it fell, and for
    those with a count before that this run skipped (time box, no tiny model): not measured, not fell.
    A type with no count before counts as 0 there."""
    rose, fell, unmeasured = [], [], []
    for row in rows:
        before, after = _count(row.get("folded_before", "")), _count(row["folded"])
        change = f"{row['model_type']}: {row['folded_before'] or 0} → {row['folded'] or row['status']}"
        if row["status"] == "skipped":
            if before:
                unmeasured.append(change)
        elif after > before:
            rose.append(change)
        elif after < before:
            fell.append(change)
    return rose, fell, unmeasured


def folded_summary(rows: list[dict]) -> str:
    """"12 → 20; rose in 2 types (...); fell in 0 types (none); not measured (skipped) in 1 type (...)",
    over the types measured both times."""
    rose, fell, unmeasured = folded_changes(rows)
    measured = [r for r in rows if r["status"] != "skipped"]
    total_before = sum(_count(r["folded_before"]) for r in measured)
    parts = [f"{total_before} → {sum(_count(r['folded']) for r in measured)}"]
    for what, changes in (("rose", rose), ("fell", fell), ("not measured (skipped)", unmeasured)):
        parts.append(f"{what} in {len(changes)} type{'s' * (len(changes) != 1)} ({', '.join(changes) or 'none'})")
    return "; ".join(parts)


def _count(value: str) -> int:
    return int(value) if str(value).isdigit() else 0


def write_markdown(rows: list[dict], path: Path, command: str, not_reached: list[str] = ()) -> None:
    statuses = collections.Counter(r["status"] for r in rows)
    tried = [r for r in rows if r["status"] in ("proved", "FoldError", "WRONG", "EXCEPTION")]
    lines = [
        "# The transformers zoo, folded", "",
        command_line(command),
        f"machine: {platform.machine()} {platform.processor() or ''}, {torch.get_num_threads()} threads; "
        f"torch {torch.__version__}, transformers {_version('transformers')}; commit {_commit()}  ",
        f"rows: {len(rows)}; " + ", ".join(f"{n} {s}" for s, n in statuses.most_common()) + "  ",
        f"model types: {len({r['model_type'] for r in rows})}; proved in at least one row: "
        f"{len({r['model_type'] for r in rows if r['status'] == 'proved'})}", "",
        f"With a LayerNorm: {len(tried)}; norms {sum(int(r['norms'] or 0) for r in tried)}, folded "
        f"{sum(int(r['folded'] or 0) for r in tried)}; wrong claims {statuses['WRONG']}; exceptions other than "
        f"FoldError {statuses['EXCEPTION']}.", "",
        f"FoldError by reason class: {_error_classes(rows) or 'none'}. Captured through submodules: "
        f"{sum(r['capture'].startswith('submodules') for r in rows)} rows. Missed folds by brute force "
        f"(tests/fuzz/centering_oracle.py on each norm left unfolded): {sum(_count(r['missed']) for r in rows)} "
        f"in {sum(_count(r['missed']) > 0 for r in rows)} rows (judged in float64, or in float32 where the "
        f"model runs only there); unfolded norms not judged (time box, no module at the path, outputs reached only through a discrete step): {sum(_count(r['not_judged']) for r in rows)}.", "",
    ]
    columns = columns_of(rows)
    if "folded_before" in columns:
        lines += [f"Folded norms before → after: {folded_summary(rows)}.", ""]
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]
    if not_reached:
        lines += ["", f"Not reached within --max-minutes ({len(not_reached)}): {', '.join(not_reached)}"]
    path.write_text("\n".join(lines) + "\n")


def _error_classes(rows: list[dict]) -> str:
    """"12 export limit, 3 missing input, ...": the FoldError rows by reason class (its words before any "(")."""
    counts = collections.Counter(r["error_class"].split(" (")[0] for r in rows if r["status"] == "FoldError")
    return ", ".join(f"{n} {what}" for what, n in counts.most_common())


def columns_of(rows: list[dict]) -> list[str]:
    """COLUMNS, with ``folded_before`` after ``folded`` when the rows carry it (``--before``)."""
    if rows and "folded_before" in rows[0]:
        i = COLUMNS.index("folded") + 1
        return [*COLUMNS[:i], "folded_before", *COLUMNS[i:]]
    return list(COLUMNS)


def _version(name: str) -> str:
    module = sys.modules.get(name)
    return getattr(module, "__version__", "?")


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def isolated_tester_rows(model_type: str, root: Path, max_rss_gb: float) -> list[dict]:
    """:func:`tester_rows` of one type in a child process (this script with ``--rows-of``), killed when its
    resident memory passes ``max_rss_gb`` (one "skipped" row saying so) or it runs past two time boxes."""
    command = [sys.executable, __file__, "--tests", str(root), "--rows-of", model_type,
               "--brute-force-seconds", str(BRUTE_FORCE_SECONDS)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # a tester that reaches for the hub (RepViT's timm config) fails at once
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    limit_s, start, peak = int(2 * (SECONDS_PER_TYPE + BRUTE_FORCE_SECONDS) + 120), time.monotonic(), 0.0
    why = None
    while child.poll() is None:
        peak = max(peak, _rss_gb(child.pid))
        if peak > max_rss_gb:
            why = f"resident memory passed {max_rss_gb:g} GB: stopped"
        elif time.monotonic() - start > limit_s:
            why = f"took more than {limit_s} s: stopped"
        if why:
            child.kill()
            child.wait()
            break
        time.sleep(0.5)
    out = child.stdout.read().strip().splitlines()
    if why is None and child.returncode == 0 and out:
        return json.loads(out[-1])
    row = {**dict.fromkeys(COLUMNS, ""), "model_type": model_type, "status": "skipped"}
    row["detail"] = why or f"the child process ended with code {child.returncode}"
    return [row]


def _shard(text: str) -> tuple[int, int]:
    """``--shard I/N``: (I, N) with 0 <= I < N."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N such as 0/2, got {text!r}") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"expected 0 <= I < N, got {text!r}")
    return index, count


def merge_tables(paths: list[Path], stem: Path, order: list[str]) -> list[dict]:
    """The rows of several tables (shards of one run, then reruns) as one table at ``stem`` (.csv and .md),
    ordered as ``order`` lists their types (a type not listed last); a type's rows are those of the last table
    that has it (a rerun replaces them); each table's command recorded from its .md."""
    rows = []
    for path in paths:
        with open(path, newline="") as handle:
            new = list(csv.DictReader(handle))
        rerun = {r["model_type"] for r in new}
        rows = [r for r in rows if r["model_type"] not in rerun] + new
    if not rows:
        raise ValueError(f"expected rows in {', '.join(map(str, paths))}, got none")
    position = {t: i for i, t in enumerate(order)}
    rows.sort(key=lambda r: position.get(r["model_type"], len(order)))  # stable: a type's own rows keep their order
    columns = [c for c in columns_of(rows) if c in rows[0]]
    with open(stem.with_suffix(".csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        writer.writerows(rows)
    write_markdown(rows, stem.with_suffix(".md"), merge_provenance("hf_zoo.py", paths))
    return rows


def recorded_command(markdown: Path) -> str | None:
    """What a table's .md says made it, verbatim (its backticked commands and the words between them): the text
    after the first ": " of its ``command: ...`` line (or a hand-written ``commands (...): ...`` one)."""
    for line in markdown.read_text().splitlines():
        if line.startswith("command") and ": " in line:
            return line.split(": ", 1)[1].rstrip()
    return None


def merge_provenance(script: str, paths: list) -> str:
    """The provenance line of a ``--merge`` of ``paths`` (markdown, for :func:`command_line`): its command,
    then what each input's .md recorded, so that a merge of merges still names every run its rows came from."""
    merged = f"`python benchmarks/{script} --merge {' '.join(map(str, paths))}`"
    recorded = [recorded_command(Path(p).with_suffix(".md")) for p in paths if Path(p).with_suffix(".md").is_file()]
    recorded = [c for c in recorded if c]
    return merged + ("; from: " + "; ".join(recorded) if recorded else "")


def command_line(command: str) -> str:
    """A table's ``command:`` line: ``command`` in backticks, or as it is where it is already markdown (a merge's
    provenance, :func:`merge_provenance`)."""
    return f"command: {command}  " if command.startswith("`") else f"command: `{command}`  "


def _rss_gb(pid: int) -> float:
    """The resident memory of process ``pid`` in GB (0 when it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return kib / 2 ** 20


def main(argv: list[str] | None = None) -> int:
    global BRUTE_FORCE_SECONDS  # --brute-force-seconds
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="*", help="model types (default: every type of CONFIG_MAPPING)")
    parser.add_argument("--out", default=str(RESULTS / "hf_zoo"), help="output stem (.csv and .md are added)")
    parser.add_argument("--max-minutes", type=float, default=None, help="try no new type after this long")
    parser.add_argument("--before", metavar="CSV", help="an earlier table (e.g. benchmarks/results/hf_zoo.csv): "
                        "adds its folded count as folded_before, and which types rose or fell")
    parser.add_argument("--reached-only", action="store_true", help="with --before: only the types it reached "
                        "with a LayerNorm or a FoldError (plus any --types)")
    parser.add_argument("--tests", metavar="PATH", type=Path, help="a checkout of transformers (its tests/ folder is "
                        "read): each type's config and inputs from its own ModelTester, bare model and main head "
                        "class, each type in a child process")
    parser.add_argument("--max-rss-gb", type=float, default=5.0, help="with --tests: stop a type whose process "
                        "holds more memory than this (a 'skipped' row)")
    parser.add_argument("--brute-force-seconds", type=float, default=BRUTE_FORCE_SECONDS, help="the missed-fold "
                        "brute force of one row judges no new norm after this long (the rest: not judged)")
    parser.add_argument("--shard", metavar="I/N", type=_shard, help="every N-th type from the I-th (0-based): run "
                        "N shards at once on N cores, then --merge their tables")
    parser.add_argument("--merge", metavar="CSV", nargs="+", help="one table (--out) of these tables' rows, in the "
                        "order of the type list, a type's rows from the last table that has it (reruns last), "
                        "their commands recorded; nothing is run")
    parser.add_argument("--rows-of", metavar="TYPE", help=argparse.SUPPRESS)  # the child process of --tests
    args = parser.parse_args(argv)
    if args.brute_force_seconds <= 0:
        parser.error(f"--brute-force-seconds must be > 0, got {args.brute_force_seconds:g}")
    BRUTE_FORCE_SECONDS = args.brute_force_seconds  # read by every row's time box and the brute force
    if args.tests is not None and not (args.tests / "tests" / "models").is_dir():
        parser.error(f"--tests needs a transformers checkout with tests/models/, got {args.tests}")
    if args.reached_only and not args.before:
        parser.error("--reached-only needs --before CSV")
    before = read_table(args.before) if args.before else None
    warnings.filterwarnings("ignore")
    zoo = _zoo_helpers()
    zoo.transformers.logging.set_verbosity_error()
    if args.merge:
        merge_tables([Path(p) for p in args.merge], Path(args.out), model_types(zoo, args.types))
        return 0
    if args.rows_of:
        print(json.dumps(tester_rows(args.rows_of, args.tests, zoo, _testers_module())), flush=True)
        return 0
    stem = Path(args.out)
    command = "python benchmarks/hf_zoo.py" + (f" --types {' '.join(args.types)}" if args.types else "")
    if args.max_minutes is not None:
        command += f" --max-minutes {args.max_minutes:g}"
    if before is not None:
        command += f" --before {args.before}" + (" --reached-only" if args.reached_only else "")
    if args.tests is not None:
        command += f" --tests {args.tests} --max-rss-gb {args.max_rss_gb:g}"
    if args.brute_force_seconds != parser.get_default("brute_force_seconds"):
        command += f" --brute-force-seconds {args.brute_force_seconds:g}"
    if args.reached_only:
        types = list(dict.fromkeys([*reached_types(before), *(args.types or [])]))
    else:
        types = model_types(zoo, args.types)
    if args.shard is not None:
        types = types[args.shard[0]::args.shard[1]]
        command += f" --shard {args.shard[0]}/{args.shard[1]}"
    rows, start = [], time.monotonic()
    columns = columns_of([{"folded_before": ""}] if before is not None else [])
    with open(stem.with_suffix(".csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        for i, model_type in enumerate(types):
            if args.max_minutes is not None and time.monotonic() - start > 60 * args.max_minutes:
                write_markdown(rows, stem.with_suffix(".md"), command, not_reached=types[i:])
                break
            new = (isolated_tester_rows(model_type, args.tests, args.max_rss_gb) if args.tests is not None
                   else [fold_row(model_type, zoo)])
            for row in new:
                if before is not None:
                    row["folded_before"] = folded_before(row, before)
                writer.writerow(row)
                print(" | ".join(str(row[c]) for c in COLUMNS[:9]), flush=True)
            rows += new
            handle.flush()
            write_markdown(rows, stem.with_suffix(".md"), command, not_reached=types[i + 1:])
    if before is not None:
        print(f"folded norms before → after: {folded_summary(rows)}", flush=True)
    return 1 if any(r["status"] in ("WRONG", "EXCEPTION") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
