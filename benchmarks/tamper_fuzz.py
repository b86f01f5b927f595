"""Tamper fuzzer: does ``normfold verify`` notice one small change to a folder normfold wrote?

    python benchmarks/tamper_fuzz.py                  # 500 trials, seed 0 -> benchmarks/results/tamper_fuzz.{csv,md}
    python benchmarks/tamper_fuzz.py --n 50 --seed 3 --out benchmarks/results/tamper_smoke
    python benchmarks/tamper_fuzz.py --trial 17 --trial 42 --keep   # rerun two trials, keep their folders
    python benchmarks/tamper_fuzz.py --quick          # a handful of trials: the instrument itself

A pool is built once: tiny random GPT-2 and OPT causal LMs with a character tokenizer (one GPT-2 also
saved in shards), a tiny BERT with a WordPiece tokenizer and sentence-transformers files, all with
non-trivial LayerNorm γ/β (the configs of tests/hf/conftest.py), and the folders normfold writes from
them: ``fold`` (also ``--dtype bfloat16``, ``--stream``, and the streamed fold of the sharded copy),
``rotate`` (hadamard; pca with ``--calibration``, whole and sliced) and ``fold --approximate
--calibration``. Every untouched output must pass verify first (the controls); otherwise detection
means nothing and the run stops with exit code 2.

Each trial (its own seeded generator: trial ``k`` of seed ``s`` makes the same change on every run,
up to the absolute paths the reports record) copies one output folder and makes ONE change of one of
four kinds: one element of one stored tensor, one byte of a non-weight file, one field of
``normfold_report.json``, or a weight file added, renamed, redirected or rewritten. Then ``normfold
verify ORIGINAL COPY`` runs in-process (``verify_argv`` is its one command line).

A change is *inert* only when it provably leaves what loads alone: the same file names, and every file
byte-identical, or JSON equal once parsed (types included, duplicate keys refused), or safetensors with
the same metadata and bit-identical tensors. Every other change must be detected (exit code != 0),
including those a stock loader happens to ignore (a ``pytorch_model.bin`` beside the safetensors, a
tensor the model has no parameter for): a second source of weights is a folder that loads differently
elsewhere. Exit 0 on a change that must be detected is a *miss*. The detection rate is detected /
must-detect trials, against the issue's 99 % bar. Exit code: 0 at or above the bar, 1 below it, 2 when
a control fails.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import functools
import io
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny configs of tests/hf/conftest.py

BAR = 0.99  # the bar: detected / changes that alter what loads
REPORT_JSON = "normfold_report.json"
CHANGE_KINDS = ("tensor element", "side-file byte", "report field", "weight file")
_WEIGHT_SUFFIXES = (".safetensors", ".bin")
_INDEX = "model.safetensors.index.json"
_WORDS = ("the a cat dog sat ran on under mat house big small red blue fast slow and with tree "
          "bird sang sky river flows over stone green old new").split()


# ---------------------------------------------------------------------------------------- the pool

@dataclasses.dataclass(frozen=True)
class Output:
    """One folder normfold wrote: what it is, the original it came from, and the options its command
    was given that verify may take too (``--calibration FILE``, ``--min-cosine X``)."""

    kind: str
    source: Path
    path: Path
    verify_options: tuple[tuple[str, str], ...] = ()


def _nontrivial_norms(model) -> None:
    """γ/β away from 1/0, as a trained model has, so that folding them is exercised, not skipped."""
    import torch

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.1)


def _tiny_model(name: str):
    import torch
    import transformers
    from hf.conftest import _HEADS, _tiny_configs  # not at the top: needs transformers and pytest

    torch.manual_seed(0)
    model = getattr(transformers, _HEADS[name])(_tiny_configs()[name])
    _nontrivial_norms(model)
    return model


def _character_tokenizer(vocab_size: int):
    """Offline: token i is the character chr(32 + i), one token per character."""
    import tokenizers
    import transformers

    table = {chr(32 + i): i for i in range(vocab_size)}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(table, unk_token="~"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), "isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="~", eos_token=" ", pad_token=" ")


def _sentence_encoder_files(folder: Path) -> None:
    """The files that make a BERT folder a sentence-transformers pipeline (mean pooling)."""
    files = {
        "modules.json": [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                         {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}],
        "sentence_bert_config.json": {"max_seq_length": 32, "do_lower_case": False},
        "config_sentence_transformers.json": {"similarity_fn_name": "cosine"},
        "1_Pooling/config.json": {"word_embedding_dimension": 32, "pooling_mode_cls_token": False,
                                  "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False},
    }
    for rel, content in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(json.dumps(content, indent=2) + "\n")


def build_sources(root: Path) -> dict[str, tuple[Path, Path]]:
    """name -> (model folder, calibration file) of the tiny originals."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bars in the run's output

    root.mkdir(parents=True, exist_ok=True)
    text = root / "calibration_text.txt"
    text.write_text("\n".join(f"The {i}th LAYER folds, {i * 7 % 13} times OVER." for i in range(16)) + "\n")
    sources = {}
    for name in ("gpt2", "opt"):
        model = _tiny_model(name)
        model.save_pretrained(root / name)
        _character_tokenizer(model.config.vocab_size).save_pretrained(root / name)
        sources[name] = (root / name, text)
    sharded = root / "gpt2_sharded"
    _tiny_model("gpt2").save_pretrained(sharded, max_shard_size="40KB")
    _character_tokenizer(96).save_pretrained(sharded)
    sources["gpt2_sharded"] = (sharded, text)

    vocab = root / "bert_vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_WORDS]) + "\n")
    words = root / "calibration_words.txt"
    gen = random.Random(0)
    words.write_text("\n".join(" ".join(gen.choice(_WORDS) for _ in range(gen.randint(3, 8))) for _ in range(16)))
    _tiny_model("bert").save_pretrained(root / "bert")
    transformers.BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(root / "bert")
    _sentence_encoder_files(root / "bert")
    sources["bert"] = (root / "bert", words)
    return sources


_CAL = "{calibration}"  # stands for the source's calibration file in POOL
_WITH_CALIBRATION = (("--calibration", _CAL),)

# kind -> (source, command, its options after -o OUT, the options verify is given when it takes them)
POOL = {
    "fold:gpt2": ("gpt2", "fold", (), ()),
    "fold:opt": ("opt", "fold", (), ()),
    "fold:bert-st": ("bert", "fold", (), ()),
    "fold-bf16:gpt2": ("gpt2", "fold", ("--dtype", "bfloat16"), ()),
    "fold-stream:opt": ("opt", "fold", ("--stream",), ()),
    "fold-sharded:gpt2": ("gpt2_sharded", "fold", (), ()),
    "rotate-hadamard:gpt2": ("gpt2", "rotate", (), ()),
    "rotate-hadamard:opt": ("opt", "rotate", ("--seed", "5"), ()),
    "rotate-pca:gpt2": ("gpt2", "rotate", ("--method", "pca", "--calibration", _CAL), _WITH_CALIBRATION),
    "rotate-pca-sliced:gpt2": ("gpt2", "rotate", ("--method", "pca", "--calibration", _CAL, "--slice", "0.25"),
                               (*_WITH_CALIBRATION, ("--min-cosine", "0.85"))),  # its measured cosine: 0.878
    "approximate:bert-st": ("bert", "fold", ("--approximate", "--calibration", _CAL, "--min-cosine", "0.9"),
                            (*_WITH_CALIBRATION, ("--min-cosine", "0.9"))),
}


def build_pool(root: Path, kinds=None) -> list[Output]:
    """The sources, then one output folder per POOL kind (all of them unless ``kinds`` names some)."""
    sources = build_sources(root / "sources")
    pool = []
    for kind in kinds or POOL:
        name, command, options, verify_options = POOL[kind]
        source, text = sources[name]
        out = root / "outputs" / kind.replace(":", "_")
        argv = [command, str(source), "-o", str(out), *(str(text) if a == _CAL else a for a in options)]
        code, _, stderr = _run_cli(argv)
        if code != 0:
            raise RuntimeError(f"building {kind}: normfold {' '.join(argv)} exited {code}: {stderr[-2000:]}")
        pool.append(Output(kind, source, out, tuple((o, str(text) if v == _CAL else v) for o, v in verify_options)))
    return pool


# ------------------------------------------------------------------------------------------ verify

def _run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``normfold ARGV`` in this process: (exit code, stdout, stderr)."""
    from normfold import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except Exception as error:  # noqa: BLE001  a crash would exit 1 in a process of its own; say what it was
            print(f"uncaught {type(error).__name__}: {error}", file=err)
            code = 1
    return code, out.getvalue(), err.getvalue()


@functools.cache
def verify_options() -> frozenset[str]:
    """The option strings the installed ``normfold verify`` parser accepts."""
    from normfold.cli import build_parser, subcommand_parsers

    parser = subcommand_parsers(build_parser())["verify"]
    return frozenset(s for action in parser._actions for s in action.option_strings)


def verify_argv(original, folder, options=()) -> list[str]:
    """The one verify command line of every trial and control: ``verify ORIGINAL FOLDER``, then each
    ``(option, value)`` the folder's command was given that the installed verify parser has (today's
    has neither ``--calibration`` nor ``--min-cosine``: it reads both from the folder)."""
    argv = ["verify", str(original), str(folder)]
    for option, value in options:
        if option in verify_options():
            argv += [option, str(value)]
    return argv


def run_verify(output: Output, folder: Path) -> tuple[int, str]:
    """(exit code, what verify said: its last error line, else its last output line)."""
    code, stdout, stderr = _run_cli(verify_argv(output.source, folder, output.verify_options))
    said = [ln.strip() for ln in stderr.splitlines() if ln.startswith(("normfold: error", "normfold: verification",
                                                                        "uncaught"))]
    said = said or [ln.strip() for ln in stdout.splitlines() if ln.strip()]
    return code, (said[-1] if said else "")[:200]


# ----------------------------------------------------------------------------------------- changes

@dataclasses.dataclass(frozen=True)
class Change:
    kind: str         # one of CHANGE_KINDS
    op: str           # the sub-kind (e.g. "negate", "json whitespace", "delete field")
    description: str  # exactly what was changed, enough to redo it by hand


def _read_safetensors(path: Path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}, f.metadata()


def _write_safetensors(path: Path, tensors: dict, metadata) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)


def _loaded_weight_files(folder: Path) -> list[Path]:
    """The safetensors files of the untampered layout, as normfold resolves them (an index's shards, or the
    single file: ``model.safetensors``, or ``normfold_model.safetensors`` in a folder only normfold loads)."""
    from normfold.hf.weight_files import weight_source

    return [folder / name for name in weight_source(folder).files]


def _index_file(folder: Path) -> Path:
    """The untampered layout's index (``model.safetensors.index.json``, or normfold's own name), or where a
    new one for the stock name goes."""
    from normfold.hf.weight_files import weight_source

    source = weight_source(folder)
    return folder / (source.entry if source.is_index else _INDEX)


def _all_tensors(folder: Path) -> dict:
    tensors = {}
    for path in _loaded_weight_files(folder):
        tensors.update(_read_safetensors(path)[0])
    return tensors


def change_element(tensor, rng: random.Random) -> tuple[str, str]:
    """Change one element of ``tensor`` in place to another value; half the time in its upper rows
    (high token ids and positions: rows a short check input never reaches). Returns (op, what was done)."""
    import torch

    flat = tensor.view(-1)
    if tensor.dim() >= 2 and tensor.shape[0] >= 8 and rng.random() < 0.5:
        row_size = flat.numel() // tensor.shape[0]
        row = rng.randrange(tensor.shape[0] // 2, tensor.shape[0])
        position = row * row_size + rng.randrange(row_size)
    else:
        position = rng.randrange(flat.numel())
    index = list(torch.unravel_index(torch.tensor(position), tensor.shape)) if tensor.dim() else []
    where = f"[{', '.join(str(int(i)) for i in index)}]"
    old = flat[position].clone()
    if tensor.dtype == torch.bool:
        flat[position] = ~old
        return "flip", f"{where}: {bool(old)} -> {bool(flat[position])}"
    if not tensor.dtype.is_floating_point:
        flat[position] = old + rng.choice((-1, 1))
        return "+-1", f"{where}: {int(old)} -> {int(flat[position])}"
    value = float(old)
    scale = float(tensor.double().pow(2).mean().sqrt()) or 1e-2  # the tensor's typical magnitude
    op = rng.choice(("scale", "negate", "add", "zero") if value != 0.0 else ("add",))
    delta = scale * 10 ** rng.uniform(-3, 0) * rng.choice((-1, 1))
    new = {"scale": value * rng.choice((0.25, 0.5, 0.9, 1.1, 2.0, 4.0)), "negate": -value, "zero": 0.0,
           "add": value + delta}[op]
    while torch.tensor(new, dtype=tensor.dtype).view(-1).equal(old.view(-1)):  # rounded back in a narrow dtype
        new, op = value + (delta := 4 * delta), "add"
    flat[position] = new
    return op, f"{where} {op}: {value:.6g} -> {float(flat[position]):.6g} (tensor rms {scale:.3g})"


def _tamper_tensor(folder: Path, rng: random.Random, pool) -> Change:
    path = rng.choice(sorted(folder.rglob("*.safetensors")))
    tensors, metadata = _read_safetensors(path)
    name = rng.choice(sorted(tensors))
    op, what = change_element(tensors[name], rng)
    _write_safetensors(path, tensors, metadata)
    return Change("tensor element", op,
                  f"{path.relative_to(folder)}: {name} {tuple(tensors[name].shape)} {tensors[name].dtype} {what}")


def _json_whitespace_offsets(data: bytes) -> list[int]:
    """Offsets of whitespace between JSON tokens (outside strings)."""
    offsets, in_string, escaped = [], False, False
    for i, byte in enumerate(data):
        if in_string:
            escaped, in_string = (not escaped and byte == 0x5C), in_string and (escaped or byte != 0x22)
        elif byte == 0x22:
            in_string = True
        elif byte in b" \t\n\r":
            offsets.append(i)
    return offsets


def _other_byte(old: int, rng: random.Random, mode: str) -> int:
    classes = (b"0123456789", b"abcdefghijklmnopqrstuvwxyz", b"ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    if mode == "json whitespace":
        pool = b" \t\n\r"
    elif mode == "same-class byte":
        pool = next((c for c in classes if old in c), bytes(range(0x21, 0x7F)))
    else:
        pool = bytes(range(256))
    return rng.choice([b for b in pool if b != old])


def _tamper_side_byte(folder: Path, rng: random.Random, pool) -> Change:
    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.suffix not in _WEIGHT_SUFFIXES
             and p.name != REPORT_JSON]
    path = rng.choice(files)
    data = bytearray(path.read_bytes())
    whitespace = _json_whitespace_offsets(bytes(data)) if path.suffix == ".json" else []
    draw = rng.random()
    mode = "json whitespace" if whitespace and draw < 0.15 else "same-class byte" if draw < 0.75 else "random byte"
    offset = rng.choice(whitespace) if mode == "json whitespace" else rng.randrange(len(data))
    old = data[offset]
    data[offset] = _other_byte(old, rng, mode)
    path.write_bytes(bytes(data))
    context = bytes(data[max(0, offset - 12):offset + 12])
    return Change("side-file byte", mode, f"{path.relative_to(folder)} byte {offset} of {len(data)}: "
                                          f"{bytes([old])!r} -> {bytes([data[offset]])!r} (now ...{context!r}...)")


_DELETE = object()  # an edit's new value that deletes the field
_ABSENT = "(absent)"


def _paths(value, prefix=()):
    """Every (path, value) under a JSON value, the root excluded."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield (*prefix, key), child
        yield from _paths(child, (*prefix, key))


def _parent(report, path):
    for key in path[:-1]:
        report = report[key]
    return report


def _altered(value, rng: random.Random):
    """Another value of the same JSON type (a number, a flag, a string, a list one item shorter)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return rng.choice([v for v in (-1, 0, value * 2, value + 1, -value) if v != value])
    if isinstance(value, str):
        return value[:-1] + ("x" if value[-1:] != "x" else "y")
    if isinstance(value, list):
        return value[:-1] if value else [0]
    if isinstance(value, dict):
        return {} if value else {"tampered": True}
    return 0


def _targeted_report_edits(report: dict) -> list[tuple[str, tuple, object]]:
    """The edits issue 29 names: (op, path, new value or _DELETE)."""
    edits = [("delete plan", ("plan",), _DELETE)] if "plan" in report else []
    for path, value in _paths(report):
        key = path[-1]
        if key == "min_cosine" and isinstance(value, (int, float)):
            edits.append(("min_cosine -1", path, -1))
        elif key == "weight" and isinstance(value, bool) and "swapped" in path:
            edits.append(("flip swapped weight flag", path, not value))
        elif isinstance(key, str) and "shape" in key and isinstance(value, list) and value:
            edits.append(("change recorded shape", path, [*value[:-1], value[-1] + 1]))
    return edits


def _report_edit(report: dict, rng: random.Random, others: list[dict]) -> tuple[str, tuple, object]:
    """One random edit of the report: (op, path, new value or _DELETE)."""
    targeted = _targeted_report_edits(report)
    op = rng.choice(["delete field", "alter field", "add field"] + (["targeted"] if targeted else []))
    if op == "targeted":  # each named edit as likely as the others, however many fields it could hit
        name = rng.choice(sorted({edit[0] for edit in targeted}))
        return rng.choice([edit for edit in targeted if edit[0] == name])
    if op == "delete field":
        return op, rng.choice([p for p, _ in _paths(report) if isinstance(_parent(report, p), dict)]), _DELETE
    if op == "alter field":
        where, old = rng.choice(list(_paths(report)))
        return op, where, _altered(old, rng)
    borrowable = sorted({k for other in others for k in other if k not in report})
    if borrowable and rng.random() < 0.5:  # a section another kind of folder has (e.g. "rotation")
        key = rng.choice(borrowable)
        return "add another folder's section", (key,), next(other[key] for other in others if key in other)
    dicts = [()] + [p for p, v in _paths(report) if isinstance(v, dict)]
    return op, (*rng.choice(dicts), "tampered"), True


def _tamper_report(folder: Path, rng: random.Random, pool) -> Change:
    path = folder / REPORT_JSON
    report = json.loads(path.read_text())
    op, where, new = _report_edit(report, rng, [json.loads((o.path / REPORT_JSON).read_text()) for o in pool])
    parent = _parent(report, where)
    present = where[-1] in parent if isinstance(parent, dict) else where[-1] < len(parent)
    before = json.dumps(parent[where[-1]])[:80] if present else _ABSENT
    if new is _DELETE:
        del parent[where[-1]]
    else:
        parent[where[-1]] = new
    path.write_text(json.dumps(report, indent=2) + "\n")
    after = "(deleted)" if new is _DELETE else json.dumps(new)[:80]
    return Change("report field", op, f"{'.'.join(map(str, where))}: {before} -> {after}")


def _tampered_copy(folder: Path, rng: random.Random) -> tuple[dict, str, str]:
    """All loaded tensors, one element changed: what a stale or second weight file holds.
    Returns (tensors, the changed tensor's name, what was changed)."""
    tensors = _all_tensors(folder)
    name = rng.choice(sorted(tensors))
    return tensors, name, f"{name} {change_element(tensors[name], rng)[1]}"


def _weight_ops(folder: Path) -> list[str]:
    sharded = _index_file(folder).is_file()
    return ["pytorch_model.bin beside", "transformers_weights alt file", "variant file", "tensor dropped",
            "tensor added", "tensor dtype changed",
            *(("stale single file beside index", "shard renamed", "index entry redirected") if sharded
              else ("index beside single file",))]


def _tamper_weight_file(folder: Path, rng: random.Random, pool) -> Change:
    import torch

    op = rng.choice(_weight_ops(folder))
    if op in ("tensor dropped", "tensor added", "tensor dtype changed"):
        path = rng.choice(_loaded_weight_files(folder))
        tensors, metadata = _read_safetensors(path)
        name = rng.choice(sorted(tensors))
        if op == "tensor dropped":
            what = f"{name} deleted"
            del tensors[name]
        elif op == "tensor added":
            what = f"{name}_extra (3 zeros) added"
            tensors[f"{name}_extra"] = torch.zeros(3)
        else:
            dtype = torch.float16 if tensors[name].dtype != torch.float16 else torch.float32
            what = f"{name} stored as {dtype} instead of {tensors[name].dtype}"
            tensors[name] = tensors[name].to(dtype)
        _write_safetensors(path, tensors, metadata)
        return Change("weight file", op, f"{path.name}: {what}")
    if op == "shard renamed":
        shard = rng.choice(_loaded_weight_files(folder))
        shard.rename(shard.with_name(f"renamed-{shard.name}"))
        return Change("weight file", op, f"{shard.name} -> renamed-{shard.name}, the index unchanged")
    tensors, changed, what = _tampered_copy(folder, rng)
    if op == "pytorch_model.bin beside":
        torch.save(tensors, folder / "pytorch_model.bin")
        target = "pytorch_model.bin"
    elif op == "transformers_weights alt file":
        config = json.loads((folder / "config.json").read_text())
        config["transformers_weights"] = target = "alt.safetensors"
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _write_safetensors(folder / target, tensors, {"format": "pt"})
    elif op == "variant file":
        _write_safetensors(folder / (target := "model.fp16.safetensors"), tensors, {"format": "pt"})
    elif op == "stale single file beside index":
        _write_safetensors(folder / (target := "model.safetensors"), tensors, {"format": "pt"})
    elif op == "index beside single file":
        target = "model-00001-of-00001.safetensors"
        _write_safetensors(folder / target, tensors, {"format": "pt"})
        index = {"metadata": {}, "weight_map": {name: target for name in tensors}}
        (folder / _INDEX).write_text(json.dumps(index, indent=2) + "\n")
    else:  # index entry redirected: the changed tensor alone in a new shard the index points at
        index_file = _index_file(folder)
        index = json.loads(index_file.read_text())
        index["weight_map"][changed] = target = "model-extra.safetensors"
        index_file.write_text(json.dumps(index, indent=2) + "\n")
        _write_safetensors(folder / target, {changed: tensors[changed]}, {"format": "pt"})
    return Change("weight file", op, f"{target} holds the weights with {what}")


TAMPERS = {"tensor element": _tamper_tensor, "side-file byte": _tamper_side_byte, "report field": _tamper_report,
           "weight file": _tamper_weight_file}


# -------------------------------------------------------------------------- what loads: inert or not

def _unique_keys(pairs):
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError("duplicate key")
    return dict(pairs)


def _parse_json(path: Path):
    return json.loads(path.read_bytes().decode("utf-8"), object_pairs_hook=_unique_keys)


def _same_json(a, b) -> bool:
    """Equal JSON values, types included (1 is not 1.0, true is not 1)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b))
    return a == b


def _bits(tensor):
    import torch

    return tensor.reshape(-1).contiguous().view(torch.uint8)


def _same_tensors(a: Path, b: Path) -> bool:
    (ta, ma), (tb, mb) = _read_safetensors(a), _read_safetensors(b)
    return ma == mb and ta.keys() == tb.keys() and all(
        ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape and _bits(ta[k]).equal(_bits(tb[k])) for k in ta)


def _same_content(a: Path, b: Path) -> str | None:
    """Why two different byte strings load the same, or None when they may not."""
    try:
        if a.suffix == ".json" and _same_json(_parse_json(a), _parse_json(b)):
            return "JSON equal once parsed"
        if a.suffix == ".safetensors" and _same_tensors(a, b):
            return "the same tensors, bit for bit, and metadata"
    except Exception:  # noqa: BLE001  no longer parses (SafetensorError is none of the builtin errors): not the same
        return None
    return None


def inert_reason(pristine: Path, tampered: Path) -> str | None:
    """Why the tampered folder provably loads as the pristine one does, or None when it may not."""
    files = {p.relative_to(pristine): p for p in pristine.rglob("*") if p.is_file()}
    changed = {p.relative_to(tampered): p for p in tampered.rglob("*") if p.is_file()}
    if files.keys() != changed.keys():
        return None
    reasons = []
    for rel in sorted(files):
        if files[rel].read_bytes() != changed[rel].read_bytes():
            reason = _same_content(files[rel], changed[rel])
            if reason is None:
                return None
            reasons.append(f"{rel}: {reason}")
    return "; ".join(reasons) or "no file changed"


# ---------------------------------------------------------------------------------------- a trial

def trial_rng(seed: int, trial: int) -> random.Random:
    return random.Random(f"tamper-fuzz:{seed}:{trial}")


def run_trial(trial: int, seed: int, pool: list[Output], work: Path, keep: bool = False, tamper=None) -> dict:
    """Copy one output, make one change (``tamper(folder, rng, pool)``, else a random kind's), classify
    it and run verify. Returns the CSV row."""
    rng = trial_rng(seed, trial)
    output = rng.choice(pool)
    kind = rng.choice(CHANGE_KINDS)
    folder = work / f"trial{trial:05d}" / output.path.name
    shutil.copytree(output.path, folder)
    started = time.perf_counter()
    change = (tamper or TAMPERS[kind])(folder, rng, pool)
    inert = inert_reason(output.path, folder)
    code, said = run_verify(output, folder)
    if not keep:
        shutil.rmtree(folder.parent)
    outcome = ("inert, flagged" if code else "inert") if inert else ("detected" if code else "MISSED")
    return {"trial": trial, "folder": output.kind, "change_kind": change.kind, "op": change.op,
            "change": change.description, "alters_load": "no" if inert else "yes", "inert_reason": inert or "",
            "exit_code": code, "outcome": outcome, "verify_said": said,
            "seconds": f"{time.perf_counter() - started:.2f}"}


# ------------------------------------------------------------------------------------------ output

def _rate(rows) -> tuple[int, int, str]:
    must = [r for r in rows if r["alters_load"] == "yes"]
    detected = sum(r["outcome"] == "detected" for r in must)
    return detected, len(must), f"{detected}/{len(must)} ({100 * detected / len(must):.1f} %)" if must else "-"


def _explain(row, explanations: dict) -> str:
    """The first of ``explanations`` that matches the miss, most specific first ("" when none does)."""
    family = row["folder"].split(":")[0]  # "rotate-pca" of "rotate-pca:gpt2"
    for key in (f"{row['folder']}|{row['op']}", f"{family}|{row['op']}", f"{row['folder']}|{row['change_kind']}",
                f"{family}|{row['change_kind']}", row["op"], row["change_kind"]):
        if key in explanations:
            return explanations[key]
    return ""


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _machine() -> str:
    import torch
    import transformers

    return (f"{platform.node() or 'unknown'}, {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs; Python {platform.python_version()}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}")


def _git(*args) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30,
                              check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def write_results(rows, controls, stem: Path, meta: dict, explanations: dict) -> tuple[Path, Path]:
    stem.parent.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = stem.with_suffix(".csv"), stem.with_suffix(".md")
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    detected, must, overall = _rate(rows)
    verdict = "meets" if must and detected / must >= BAR else "below"
    lines = [
        "# Tamper fuzzer: `normfold verify` against one change to a folder normfold wrote", "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}  ",
        f"Code: {meta['code']}  ",
        (f"Duration: pool {meta['pool_s']:.0f} s, {len(rows)} trials {meta['trials_s']:.0f} s "
         f"(median {statistics.median(float(r['seconds']) for r in rows):.2f} s a trial)  "),
        ("Verify runs in-process (`normfold.cli.main`) as `normfold verify ORIGINAL FOLDED`, plus those of the "
         f"folder's options the installed verify has ({meta['verify_takes']}: see the controls)."), "",
        ("A change is inert only when it provably leaves what loads alone (same file names; every file "
         "byte-identical, or JSON equal once parsed, or the same tensors bit for bit); every other change "
         "must make verify exit nonzero. `benchmarks/tamper_fuzz.py`'s docstring has the rules."), "",
        "## Controls: every untouched output passes verify", "",
        "| folder | options given to verify | exit code | verify said |", "|---|---|---|---|",
        *(f"| {kind} | {_cell(options) or '-'} | {code} | {_cell(said)} |"
          for kind, (code, said, options) in controls.items()), "",
        (f"## Result: {overall} of the changes that alter what loads detected: {verdict} the "
         f"{100 * BAR:.0f} % bar"), "",
        (f"Inert changes: {sum(r['alters_load'] == 'no' for r in rows)} (of them flagged anyway: "
         f"{sum(r['outcome'] == 'inert, flagged' for r in rows)})."), "",
        "## Detected / must detect, by folder and change kind", "",
        "| folder | " + " | ".join(CHANGE_KINDS) + " | all |", "|---" * (len(CHANGE_KINDS) + 2) + "|",
    ]
    for kind in sorted({r["folder"] for r in rows}):
        of_kind = [r for r in rows if r["folder"] == kind]
        cells = [_rate([r for r in of_kind if r["change_kind"] == c])[2] for c in CHANGE_KINDS]
        lines.append(f"| {kind} | " + " | ".join(cells) + f" | {_rate(of_kind)[2]} |")
    lines.append("| all | " + " | ".join(_rate([r for r in rows if r["change_kind"] == c])[2] for c in CHANGE_KINDS)
                 + f" | {overall} |")
    lines += ["", "## By change", "", "| change kind | op | trials | inert | detected / must detect |",
              "|---|---|---|---|---|"]
    for kind, op in sorted({(r["change_kind"], r["op"]) for r in rows}):
        of_op = [r for r in rows if (r["change_kind"], r["op"]) == (kind, op)]
        lines.append(f"| {kind} | {op} | {len(of_op)} | {sum(r['alters_load'] == 'no' for r in of_op)} "
                     f"| {_rate(of_op)[2]} |")
    misses = [r for r in rows if r["outcome"] == "MISSED"]
    lines += ["", f"## Misses ({len(misses)})", "",
              ("Each is a change that alters what loads and that verify passed (exit 0). `python "
               "benchmarks/tamper_fuzz.py --seed S --trial N --keep` redoes one and keeps its folder."), "",
              "| trial | folder | change kind | change | verify said | explanation |", "|---|---|---|---|---|---|",
              *(f"| {r['trial']} | {r['folder']} | {r['change_kind']} / {r['op']} | {_cell(r['change'])} "
                f"| {_cell(r['verify_said'])} | {_cell(_explain(r, explanations))} |" for r in misses)]
    if explanations.get("_notes"):  # what the explanations file says of the run as a whole
        lines += ["", "## Notes", "", *explanations["_notes"]]
    inert = [r for r in rows if r["alters_load"] == "no"]
    lines += ["", f"## Inert changes ({len(inert)})", "", "| trial | folder | change | why inert | exit code |",
              "|---|---|---|---|---|",
              *(f"| {r['trial']} | {r['folder']} | {_cell(r['change'])} | {_cell(r['inert_reason'])} "
                f"| {r['exit_code']} |" for r in inert), ""]
    md_path.write_text("\n".join(lines))
    return csv_path, md_path


# -------------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500, help="number of trials (ids 0..n-1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every trial's generator")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tamper_fuzz",
                        help="results stem: STEM.csv and STEM.md")
    parser.add_argument("--quick", action="store_true", help="8 trials (checks the instrument, not verify)")
    parser.add_argument("--trial", type=int, action="append", help="run only this trial id (repeatable)")
    parser.add_argument("--keep", action="store_true", help="keep the tampered folders (under --work-dir)")
    parser.add_argument("--work-dir", type=Path, help="where the pool and the trials go (default: a temporary folder)")
    parser.add_argument("--explanations", type=Path,
                        help="JSON {key: text} filling the misses' explanation column; a key is 'FOLDER|OP', "
                             "'FAMILY|OP' (FAMILY: the folder kind before ':'), 'FOLDER|CHANGE KIND', "
                             "'FAMILY|CHANGE KIND', 'OP' or 'CHANGE KIND' (the first that matches); "
                             "'_notes': a list of markdown lines for a Notes section")
    args = parser.parse_args(argv)
    n = 8 if args.quick else args.n
    if n < 1:
        parser.error(f"--n must be >= 1, got {n}")
    trials = sorted(set(args.trial)) if args.trial else list(range(n))
    explanations = json.loads(args.explanations.read_text()) if args.explanations else {}

    import torch

    torch.set_num_threads(1)  # tiny models: threads only add contention on a shared CPU
    warnings.filterwarnings("ignore")
    with contextlib.ExitStack() as stack:
        work = args.work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tamper-fuzz-")))
        started = time.perf_counter()
        pool = build_pool(work / "pool")
        controls = {o.kind: (*run_verify(o, o.path), " ".join(verify_argv(o.source, o.path, o.verify_options)[3:]))
                    for o in pool}
        pool_s = time.perf_counter() - started
        failed = {k: v for k, v in controls.items() if v[0] != 0}
        if failed:
            for kind, (code, said, _) in failed.items():
                print(f"control failed: {kind}: verify exited {code}: {said}", file=sys.stderr)
            return 2
        rows = []
        for k, trial in enumerate(trials):
            rows.append(run_trial(trial, args.seed, pool, work / "trials", keep=args.keep))
            if rows[-1]["outcome"] == "MISSED" and len(trials) <= 20:
                print(f"trial {trial}: missed: {rows[-1]['folder']}: {rows[-1]['change']}", flush=True)
            if (k + 1) % 50 == 0:
                print(f"{k + 1}/{len(trials)} trials, {time.perf_counter() - started:.0f} s, "
                      f"detected {_rate(rows)[2]}", flush=True)
        trials_s = time.perf_counter() - started - pool_s
    src_commit = _git("log", "-1", "--format=%h", "--", "src")
    dirty = " (src/ has uncommitted changes)" if _git("status", "--porcelain", "--", "src") else ""
    meta = {"command": "python benchmarks/tamper_fuzz.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": _machine(), "pool_s": pool_s, "trials_s": trials_s,
            "code": f"commit {_git('rev-parse', '--short', 'HEAD')}, src/ as of commit {src_commit}{dirty}",
            "verify_takes": ", ".join(o for o in ("--calibration", "--min-cosine") if o in verify_options())
            or "neither --calibration nor --min-cosine"}
    csv_path, md_path = write_results(rows, controls, args.out, meta, explanations)
    detected, must, overall = _rate(rows)
    print(f"detected {overall} of the changes that alter what loads; wrote {csv_path} and {md_path}")
    return 0 if must and detected / must >= BAR else 1


if __name__ == "__main__":
    sys.exit(main())
