"""``normfold rotate`` on folders, measured on the bundled byte-level GPT-2 (4 x 128, trained on CPython's help).

    python benchmarks/rotate_folder.py [--lines 256] [--slices 0.1 0.2 0.3]

What the command line gives (each row runs ``normfold rotate`` in this process, on a copy of the
bundled folder with a byte tokenizer: character i is token i, as the model was trained):

- the float64 relative error of the proof of each unsliced rotation (hadamard, random, pca);
- for ``--method pca --slice F``: the kept directions and their share of the calibration energy, the
  output cosine and next-token loss on the calibration lines (from the report) and on held-out
  lines (measured here against the reloaded sliced folder, in float64);
- a sharded copy (7 shards) rotated by streaming, against the streaming fold of the same folder, and
  whether it equals the in-memory rotation bit for bit.

Text: lines of 40+ ASCII characters of ``pydoc_data.topics`` in the order the model's corpus
concatenates them (sorted keys); calibration lines from its first 90% of bytes, held-out lines from
its last 10% (the model's validation bytes, ``training.json``). Writes benchmarks/results/rotate_folder.md.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import normfold
from normfold.cli import main as normfold_main
from normfold.hf import default_model_path, example_inputs_for
from normfold.hf.load import load_model
from normfold.hf.rotate_folder import calibration_calls
from normfold.rotate.calibration import output_agreement

RESULTS = Path(__file__).resolve().parent / "results"


def split_lines(count: int) -> tuple[list[str], list[str]]:
    """(calibration, held-out): ASCII lines of 40+ characters from the corpus's first 90% and last 10% of bytes."""
    import pydoc_data.topics

    texts = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    total, offset, train, held = sum(len(t.encode()) for t in texts), 0, [], []
    for text in texts:
        start, offset = offset, offset + len(text.encode())
        side = train if offset <= 0.9 * total else held if start >= 0.9 * total else None
        if side is not None:
            side += [line.strip() for line in text.splitlines() if len(line.strip()) >= 40 and line.isascii()]
    return train[:count], held[:count]


def byte_tokenizer():
    """Character i is token i (i < 256): the bundled model's byte tokens, for ASCII text."""
    import tokenizers
    import transformers

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({chr(i): i for i in range(256)}, unk_token="?"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), "isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="?", eos_token=chr(0),
                                                pad_token=chr(0))


def rotate(source: Path, out: Path, *options: str) -> tuple[dict, float]:
    """``normfold rotate SOURCE -o OUT OPTIONS --json`` in process: (the report, seconds)."""
    t0 = time.perf_counter()
    code = normfold_main(["rotate", str(source), "-o", str(out), "--json", *options])
    seconds = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(f"normfold rotate {' '.join(options)} exited {code}")
    return json.loads((out / "normfold_report.json").read_text()), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=256, help="calibration and held-out lines each (default 256)")
    parser.add_argument("--slices", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    args = parser.parse_args()
    torch.set_num_threads(1)
    calibration, held = split_lines(args.lines)
    work = Path(tempfile.mkdtemp(prefix="normfold-rotate-bench-"))
    try:
        rows, sliced_rows, sharded = run(work, calibration, held, args.slices)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_markdown(rows, sliced_rows, sharded, len(calibration), len(held), " ".join(sys.argv[1:]))


def run(work: Path, calibration: list[str], held: list[str], slices: list[float]):
    source = work / "bundled"
    shutil.copytree(default_model_path(), source)
    byte_tokenizer().save_pretrained(source)
    (work / "calibration.txt").write_text("\n".join(calibration) + "\n")
    pca = ("--method", "pca", "--calibration", str(work / "calibration.txt"))
    rotate(source, work / "warm-up")  # untimed: the first run pays for imports and the first export
    rows = []
    for name, options in (("hadamard", ("--method", "hadamard")), ("random", ("--method", "random")), ("pca", pca)):
        report, seconds = rotate(source, work / name, *options)
        rows.append((name, report["verification"]["max_rel_error"], seconds))
    original = load_model(source)
    held_calls = [((), call) for call in calibration_calls(original, byte_tokenizer(), held)]
    original64 = copy.deepcopy(original).double()
    sliced_rows = []
    for fraction in slices:
        report, seconds = rotate(source, work / f"slice{fraction}", *pca, "--slice", str(fraction))
        stream, cut = report["rotation"]["streams"][0], report["rotation"]["slicing"]
        on_held = output_agreement(original64, normfold.from_pretrained(work / f"slice{fraction}").double(), held_calls)
        (cal_loss,), (held_loss,) = cut["losses"].values(), on_held.losses.values()
        sliced_rows.append({"fraction": fraction, "kept": f"{stream['kept']} of {stream['stream']['width']}",
                            "energy": stream["kept_energy"], "proof": report["verification"]["max_rel_error"],
                            "cal": (cut["min_cosine"], cut["mean_cosine"], *cal_loss),
                            "held": (on_held.min_cosine, on_held.mean_cosine, *held_loss), "seconds": seconds})
    original.save_pretrained(work / "sharded", max_shard_size="600KB")
    report, rotate_seconds = rotate(work / "sharded", work / "sharded-rotated")
    t0 = time.perf_counter()
    assert normfold_main(["fold", str(work / "sharded"), "-o", str(work / "sharded-folded"), "--json"]) == 0
    fold_seconds = time.perf_counter() - t0
    in_memory = normfold.rotate(original, example_inputs_for(original))[0].state_dict()
    streamed = normfold.from_pretrained(work / "sharded-rotated").state_dict()
    sharded = {"shards": len(list((work / "sharded").glob("*.safetensors"))), "rotate": rotate_seconds,
               "fold": fold_seconds, "error": report["verification"]["max_rel_error"],
               "tolerance": report["verification"]["tolerance"], "plan": report["streaming"]["plan_seconds"],
               "bitwise": streamed.keys() == in_memory.keys() and all(torch.equal(streamed[k], in_memory[k])
                                                                      for k in in_memory)}
    return rows, sliced_rows, sharded


def write_markdown(rows, sliced_rows, sharded, n_cal: int, n_held: int, argv: str) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = ["# `normfold rotate` on folders: the bundled byte-level GPT-2 (4 x 128)", "",
             f"Command: `python benchmarks/rotate_folder.py {argv}`".rstrip() + f" (commit {commit}, torch "
             f"{torch.__version__}, {platform.machine()}, 1 thread). Calibration: {n_cal} lines of the model's "
             f"training bytes; held-out: {n_held} lines of its validation bytes.", "",
             "| method | proof of the rotation, float64 max relative error | seconds (`normfold rotate`, in process) |",
             "|---|---|---|"]
    lines += [f"| {name} | {error:.1e} | {seconds:.1f} |" for name, error, seconds in rows]
    lines += ["", "Sliced (`--method pca --slice F`): approximate. The whole rotation is proved first; the cut is "
              "measured: output cosine per token (min / mean) and next-token loss in nats per byte, original -> sliced.",
              "", "| slice | kept | kept energy | proof before the cut | calibration cosine | calibration loss | "
              "held-out cosine | held-out loss | seconds |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sliced_rows:
        cal, held = r["cal"], r["held"]
        lines.append(f"| {r['fraction']:.0%} | {r['kept']} | {r['energy']:.6f} | {r['proof']:.1e} | {cal[0]:.5f} / "
                     f"{cal[1]:.6f} | {cal[2]:.4f} -> {cal[3]:.4f} | {held[0]:.5f} / {held[1]:.6f} | {held[2]:.4f} -> "
                     f"{held[3]:.4f} | {r['seconds']:.1f} |")
    s = sharded
    lines += ["", f"Sharded ({s['shards']} safetensors shards, streamed): `normfold rotate` {s['rotate']:.1f} s (planning "
              f"{s['plan']:.1f} s) vs `normfold fold` of the same folder {s['fold']:.1f} s; every block proved in float64 "
              f"against the original's stream times Q: max relative error {s['error']:.1e} (float32 weights; tolerance "
              f"{s['tolerance']:.1e}, measured from the original's own float32 error); tensors "
              f"{'bit for bit equal to' if s['bitwise'] else 'DIFFERENT from'} the in-memory `normfold.rotate`.", ""]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "rotate_folder.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
