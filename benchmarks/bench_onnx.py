"""ONNX Runtime benchmark: original vs folded vs folded+fused exports, interleaved, with an A/A control (issue 31).

    python benchmarks/bench_onnx.py                    # full run -> benchmarks/results/onnx.{csv,md,png}
    python benchmarks/bench_onnx.py --quick --models gpt2 --out /tmp/onnx_quick   # a smoke run: 1 layer of width 64

Every model is exported with ``normfold.export_onnx`` (proved in ONNX Runtime against the PyTorch original
before it is timed): ``original`` is torch's stock export of the original (LayerNormalization),
``control`` a second session on the same file (A/A: this run's noise), ``folded`` the folded model
(SimplifiedLayerNormalization; SkipSimplifiedLayerNormalization where a residual add feeds the norm,
by the export's graph passes), ``fused`` folded + fused (the add inside normfold's op). Each runs as
exported (``fp32``), through ONNX Runtime's transformer optimizer (``optimizer``) and with int8 dynamic
quantization (``int8``), ``--variants``; the norm nodes ONNX Runtime runs in each are printed and
written (``*_norm_nodes``), and ``*_norm_share`` is the share of its kernel time spent in norm nodes
(its profiler, ``--profile-runs`` runs). Batch 1, ``--seqs`` tokens (1 = decode-sized: one token, no KV cache;
128 = prefill-sized), ``--threads`` intra-op threads, ORT_ENABLE_ALL. Ratios are
median(original) / median(contender) with a bootstrap interval; "faster"/"slower" only where the interval
clears the control's (``normfold.bench.stats.verdict``). ``--ops`` adds the single-op table: ONNX
Runtime's LayerNormalization vs SimplifiedLayerNormalization vs RMSNormalization (opset 23), and
SkipLayerNormalization vs SkipSimplifiedLayerNormalization, alone in a graph.

Models come from ``benchmarks/bench_e2e.py``'s ``build`` (125M-class width, ``--layers`` layers, random
weights with random LayerNorm γ/β; the real all-MiniLM-L6-v2). Run it on an idle machine (``uptime``).
"""
from __future__ import annotations

import argparse
import csv
import shlex
import sys
import tempfile
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import build  # noqa: E402  the same models as the eager benchmark

import normfold  # noqa: E402
from normfold.bench import BenchConfig  # noqa: E402
from normfold.bench.stats import median_and_iqr, ratio_ci, verdict  # noqa: E402
from normfold.bench.timing import time_interleaved  # noqa: E402
from normfold.bench.results import BenchRow, plot_rows  # noqa: E402
from normfold.export import (LAYER_NORM_NODE_TYPES, RMS_NODE_TYPES, export_onnx, fold_config_for_export,  # noqa: E402
                             runtime)
from normfold.hf.inputs import example_inputs_for  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("gpt2", "opt", "bloom", "vit", "minilm")
CONTENDERS = ("original", "control", "folded", "fused")
VARIANTS = ("fp32", "optimizer", "int8")
# onnxruntime.transformers.optimizer's model type for each model: its "gpt2" type expects the legacy
# exporter's graph (its postprocessing fails on a dynamo export's Gemm without bias), so the decoders take
# the generic "bert" fusions (SkipLayerNorm, Gelu, ...)
OPTIMIZER_TYPES = {"gpt2": "bert", "opt": "bert", "bloom": "bert", "vit": "vit", "minilm": "bert"}
NORM_NODE_TYPES = (*RMS_NODE_TYPES, *LAYER_NORM_NODE_TYPES)
OP_SHAPES = ((128, 768), (1024, 768), (4096, 768), (1024, 4096), (4096, 4096))


def _randomize_layer_norms(model: torch.nn.Module) -> None:
    """Random γ/β (a trained model's are not 1/0): folding then moves real values into the linears."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=generator))
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=generator))


def export_contenders(name: str, layers: int, quick: bool, folder: Path) -> tuple[torch.nn.Module, dict]:
    """The model, and {contender: ONNX file}: the original's stock export, the folded and the fused export
    (the fold's options: ``normfold.export.fold_config_for_export``)."""
    model = build(name, layers, quick)
    if name != "minilm":
        _randomize_layer_norms(model)
    example = example_inputs_for(model)
    files = {"original": folder / f"{name}-original.onnx"}
    for contender, fuse in (("folded", False), ("fused", True)):
        converted, _ = normfold.convert(model, example, fold=fold_config_for_export(model),
                                        fuse=normfold.FuseConfig() if fuse else None)
        files[contender] = folder / f"{name}-{contender}.onnx"
        extra = {"original_path": files["original"]} if contender == "folded" else {}
        report = export_onnx(converted, example, files[contender], original=model, **extra)
        print(f"{name} {contender}: proved, error {report.error:.2e} <= {report.tolerance:.2e}; norm nodes "
              f"{ {t: n for t, n in report.node_counts.items() if n} }", file=sys.stderr)
    return model, files


def _feed(session, model: torch.nn.Module, seq: int) -> dict:
    """Batch-1 inputs of ``seq`` tokens (images: the model's own size) for the session's inputs."""
    call = example_inputs_for(model, batch=1, seq=seq)
    tensors = runtime.call_tensors((), call)
    return {i.name: t.numpy() for i, t in zip(session.get_inputs(), tensors)}


def variant_file(path: Path, variant: str, name: str) -> Path:
    """``path`` as run in ``variant``: ``fp32`` the export itself; ``optimizer`` through ONNX Runtime's
    transformer optimizer (``optimize_model``, model type :data:`OPTIMIZER_TYPES`); ``int8`` through its
    dynamic quantizer (``quantize_dynamic``, int8 weights)."""
    if variant == "fp32":
        return path
    out = path.with_name(f"{path.stem}-{variant}.onnx")
    if variant == "optimizer":
        from onnxruntime.transformers.optimizer import optimize_model  # not at the top: only this variant

        optimize_model(str(path), model_type=OPTIMIZER_TYPES[name], num_heads=0, hidden_size=0).save_model_to_file(
            str(out))
    else:
        from onnxruntime.quantization import QuantType, quantize_dynamic  # not at the top: only this variant

        quantize_dynamic(path, out, weight_type=QuantType.QInt8)
    return out


def _norm_nodes(path: Path) -> str:
    """The norm nodes of the graph ONNX Runtime runs for ``path``, in words (do they survive the variant?)."""
    counts = runtime.optimized_node_counts(path, path.with_name(f"optimized-{path.name}"))
    return ", ".join(f"{counts[t]} {t}" for t in NORM_NODE_TYPES if counts.get(t)) or "none"


def _norm_share(path: Path, feed: dict, threads: int, runs: int) -> float:
    """The share of ONNX Runtime's kernel time spent in norm nodes (its profiler, ``runs`` runs)."""
    times = runtime.op_times(path, feed, runs=runs, threads=threads)
    return sum(times.get(t, 0.0) for t in NORM_NODE_TYPES) / sum(times.values())


def bench_models(args, config: BenchConfig, folder: Path) -> list[dict]:
    rows = []
    for name in args.models:
        model, exported = export_contenders(name, args.layers, args.quick, folder)
        seqs = (0,) if name == "vit" else args.seqs  # images: one size
        for variant in args.variants:
            files = {c: variant_file(exported[c], variant, name) for c in ("original", "folded", "fused")}
            files["control"] = files["original"]  # A/A: its own session on the same file
            nodes = {c: _norm_nodes(files[c]) for c in ("original", "folded", "fused")}
            print(f"{name} {variant}: norm nodes {nodes}", file=sys.stderr)
            for threads in args.threads:
                sessions = {c: runtime.session(files[c], threads=threads) for c in CONTENDERS}
                for seq in seqs:
                    feeds = {c: _feed(sessions[c], model, max(seq, 1)) for c in CONTENDERS}
                    calls = {c: (lambda c=c: sessions[c].run(None, feeds[c]), lambda: None) for c in CONTENDERS}
                    times = time_interleaved(calls, config)
                    row = _row({"model": name, "variant": variant, "threads": threads, "seq": seq or "image"}, times,
                               config)
                    for c in ("original", "folded", "fused"):
                        row[f"{c}_norm_share"] = _norm_share(files[c], feeds[c], threads, args.profile_runs)
                        row[f"{c}_norm_nodes"] = nodes[c]
                    rows.append(row)
                    print(_markdown_line(row), file=sys.stderr)
    return rows


def _row(key: dict, times: dict[str, list[float]], config: BenchConfig) -> dict:
    """Medians (ms) and original/contender ratios with their intervals, and the verdict against the control."""
    row = dict(key, rounds=len(times["original"]))
    cis = {}
    for contender in CONTENDERS:
        row[f"{contender}_ms"] = median_and_iqr(times[contender])[0] * 1e3
        if contender != "original":
            point, low, high = ratio_ci(times["original"], times[contender], resamples=config.bootstrap,
                                        confidence=config.confidence, seed=config.seed)
            cis[contender] = (low, high)
            row[f"{contender}_ratio"], row[f"{contender}_ci"] = point, f"{low:.3f}-{high:.3f}"
    verdicts = types.SimpleNamespace(ratio_ci=cis)
    row["folded_verdict"], row["fused_verdict"] = verdict(verdicts, "folded"), verdict(verdicts, "fused")
    return row


def plot_models(rows: list[dict], path: Path) -> None:
    """The ratios with their intervals as ``normfold.bench``'s bar chart (its ratio axis), a bar group a row."""
    bars = []
    for row in rows:
        image = row["seq"] == "image"
        bar = BenchRow(model=row["model"], mode=f"{row['variant']} {row['threads']}t", batch=1,
                       seq=0 if image else row["seq"],
                       kind="image" if image else ("decode" if row["seq"] == 1 else "prefill"))
        for c in ("control", "folded", "fused"):
            low, high = (float(v) for v in row[f"{c}_ci"].split("-"))
            bar.ratio[c], bar.ratio_ci[c] = row[f"{c}_ratio"], (low, high)
        bars.append(bar)
    plot_rows(bars, path)


def _markdown_line(row: dict) -> str:
    return "| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()) + " |"


# ------------------------------------------------------------------------------------------ single ops

def _single_op_model(op: str, shape: tuple[int, int]):
    """A graph of one norm node on (M, N) fp32 (and a skip input for the Skip* ops), γ (and β) random."""
    import numpy as np  # not at the top: only the single-op table builds graphs by hand
    from onnx import TensorProto, helper, numpy_helper

    m, n = shape
    rng = np.random.default_rng(0)
    skip = op.startswith("Skip")
    inputs = ["x", "skip", "gamma"] if skip else ["x", "gamma"]
    initializers = [numpy_helper.from_array((0.5 + rng.random(n)).astype(np.float32), "gamma")]
    if op in ("LayerNormalization", "SkipLayerNormalization"):
        inputs.append("beta")
        initializers.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32) * 0.1, "beta"))
    attrs = {"epsilon": 1e-5} if skip else {"epsilon": 1e-5, "axis": -1}
    domain = "com.microsoft" if skip else ""
    node = helper.make_node(op, inputs, ["y"], domain=domain, **attrs)
    value_infos = [helper.make_tensor_value_info(i, TensorProto.FLOAT, [m, n]) for i in inputs[:2 if skip else 1]]
    graph = helper.make_graph([node], op, value_infos, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
                              initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model, {i.name: rng.standard_normal((m, n)).astype(np.float32) for i in value_infos}


OPS = {"plain": ("LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization"),
       "skip": ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization")}


def bench_single_ops(args, config: BenchConfig, folder: Path) -> list[dict]:
    rows = []
    for threads in args.threads:
        for shape in ((8, 64),) if args.quick else OP_SHAPES:
            for family, ops in OPS.items():
                calls = {}
                for op in ops:
                    model, feed = _single_op_model(op, shape)
                    path = folder / f"{op}-{shape[0]}x{shape[1]}.onnx"
                    path.write_bytes(model.SerializeToString())
                    sess = runtime.session(path, threads=threads)
                    calls[op] = (lambda s=sess, f=feed: s.run(None, f), lambda: None)
                times = time_interleaved(calls, config)
                base = ops[0]
                row = {"family": family, "threads": threads, "shape": f"{shape[0]}x{shape[1]}"}
                for op in ops:
                    row[f"{op}_us"] = median_and_iqr(times[op])[0] * 1e6
                    if op != base:  # < 1: cheaper than the LayerNorm kernel
                        point, low, high = ratio_ci(times[op], times[base], resamples=config.bootstrap,
                                                    confidence=config.confidence, seed=config.seed)
                        row[f"{op}/{base}"], row[f"{op}/{base}_ci"] = point, f"{low:.3f}-{high:.3f}"
                rows.append(row)
                print(_markdown_line(row), file=sys.stderr)
    return rows


# ------------------------------------------------------------------------------------------ output

def write_table(rows: list[dict], path: Path, title: str, command: str) -> None:
    """``path``.csv and ``path``.md: the rows, the markdown under ``title`` with the command that made it."""
    if not rows:
        return
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with open(path.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"## {title}", "", f"`{command}`", "", "| " + " | ".join(columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def _cell(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 128], help="tokens at batch 1 (1: decode-sized)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                        help="fp32: the exports; optimizer: through ORT's transformer optimizer; int8: ORT's dynamic "
                             "quantization")
    parser.add_argument("--profile-runs", type=int, default=5, help="profiled runs per contender for the norm share")
    parser.add_argument("--ops", action="store_true", help="also the single-op table")
    parser.add_argument("--no-models", action="store_true", help="only the single-op table")
    parser.add_argument("--quick", action="store_true", help="1 layer of width 64, seqs 1 and 8, 3 rounds: a smoke run")
    parser.add_argument("--out", type=Path, default=RESULTS / "onnx",
                        help="results prefix: OUT.{csv,md}, and OUT_ops.{csv,md} for the single-op table")
    args = parser.parse_args(argv)
    if args.quick:
        args.seqs, args.rounds = [1, 8], 3
    config = BenchConfig(rounds=args.rounds, min_rounds=min(args.rounds, 8), warmup=3, shape_budget_s=60.0,
                         min_round_s=0.01)
    command = "python benchmarks/bench_onnx.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_models:
            rows = bench_models(args, config, Path(tmp))
            write_table(rows, args.out, "ONNX Runtime: original vs folded vs folded+fused (ratio > 1: faster)", command)
            if rows:
                plot_models(rows, args.out.with_suffix(".png"))
        if args.ops or args.no_models:
            write_table(bench_single_ops(args, config, Path(tmp)), args.out.with_name(args.out.name + "_ops"),
                        "ONNX Runtime single ops (time ratio < 1: cheaper than the LayerNorm kernel)", command)
    print(f"wrote {args.out}.md / .csv (and {args.out.name}_ops with --ops)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
