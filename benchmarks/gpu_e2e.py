"""GPU end-to-end: original vs folded vs folded+fused models in the paper's settings (issue 7).

    bash benchmarks/gpu_e2e.sh               # one CUDA GPU, under 5 minutes (a time budget skips the rest)
    python benchmarks/gpu_e2e.py --dry-run   # the same code path on the CPU with tiny configs

Models (random weights, fp16 on the GPU): GPT-2 small (12 layers, 768 wide), an OPT-125M-class
decoder and a BERT-base-class encoder, all with 4096 positions. Batch 1 and 8, sequence 128 to
4096, no KV cache. Modes, in priority order (the budget is spent in this order): eager, eager
replayed from a CUDA graph, ``torch.compile`` (inductor) for GPT-2, ``torch.compile(mode=
"reduce-overhead")`` (inductor + CUDA graphs) for GPT-2. Contenders are interleaved call by call,
timed with CUDA events, medians over rounds, the ratio's 95% bootstrap interval from
``normfold.bench.ratio_ci``. Folding and fusing run on the CPU in float32 (with normfold's float64
verify gate), then every contender moves to the GPU in fp16.

Writes ``gpu_e2e.csv`` and ``gpu_e2e.md`` to ``$OUT`` when set, else ``benchmarks/results/``.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import inspect
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Scale:
    """What one run covers."""

    layers: int
    width: int
    heads: int
    vocab: int | None          # None: the model's own vocabulary (the LM head is part of the work)
    batches: tuple[int, ...]
    seqs: tuple[int, ...]
    compile_shapes: tuple[tuple[int, int], ...]  # (batch, seq) timed under torch.compile (GPT-2 only)
    rounds: int
    warmup: int
    budget_s: float            # wall-clock budget; what does not fit is skipped and listed
    compile_reserve_s: float   # a compiled shape starts only with this much budget left


GPU = Scale(layers=12, width=768, heads=12, vocab=None, batches=(1, 8), seqs=(128, 512, 1024, 2048, 4096),
            compile_shapes=((1, 128), (1, 1024), (8, 1024)), rounds=20, warmup=3, budget_s=260.0, compile_reserve_s=90.0)
DRY_RUN = Scale(layers=2, width=64, heads=2, vocab=500, batches=(1, 2), seqs=(8, 16), compile_shapes=((1, 8),),
                rounds=3, warmup=1, budget_s=120.0, compile_reserve_s=0.0)
CONTENDERS = ("original", "folded", "fused")


def build(name: str, scale: Scale):
    import transformers as t

    common = {"attn_implementation": "sdpa", **({"vocab_size": scale.vocab} if scale.vocab else {})}
    ffn = 4 * scale.width
    if name == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(n_layer=scale.layers, n_embd=scale.width, n_head=scale.heads,
                                              n_positions=4096, **common))
    if name == "opt":
        return t.OPTForCausalLM(t.OPTConfig(num_hidden_layers=scale.layers, hidden_size=scale.width, ffn_dim=ffn,
                                            num_attention_heads=scale.heads, word_embed_proj_dim=scale.width,
                                            max_position_embeddings=4096, **common))
    if name == "bert":
        return t.BertModel(t.BertConfig(num_hidden_layers=scale.layers, hidden_size=scale.width,
                                        num_attention_heads=scale.heads, intermediate_size=ffn,
                                        max_position_embeddings=4096, **common), add_pooling_layer=False)
    raise ValueError(f"unknown model {name!r}")


def inputs_for(model, batch: int, seq: int, device) -> dict:
    gen = torch.Generator().manual_seed(batch * 10007 + seq)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen).to(device)  # (B, T)
    kwargs = {"input_ids": ids}
    if "use_cache" in inspect.signature(type(model).forward).parameters:
        kwargs["use_cache"] = False
    return kwargs


class Timer:
    """Per-call seconds: CUDA events on the GPU, perf_counter on the CPU (dry run)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


def cuda_graph_call(model, kwargs):
    """Capture one forward into a CUDA graph; the returned function replays it (static inputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            model(**kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model(**kwargs)
    return graph.replay


def measure(calls: dict, scale: Scale, timer: Timer) -> dict[str, list[float]]:
    names = list(calls)
    times = {n: [] for n in names}
    for fn in calls.values():
        for _ in range(scale.warmup):
            fn()
    for r in range(scale.rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n].append(timer(calls[n]))
    return times


def main(argv=None) -> int:
    from normfold.bench import prepare_contenders

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, float32, tiny configs")
    parser.add_argument("--models", nargs="+", default=["gpt2", "opt", "bert"])
    parser.add_argument("--out", type=Path, help="output folder (default $OUT, else benchmarks/results)")
    parser.add_argument("--budget-s", type=float, help="wall-clock budget in seconds (default: 260 on a GPU)")
    args = parser.parse_args(argv)
    scale = DRY_RUN if args.dry_run else GPU
    if args.budget_s is not None:
        scale = dataclasses.replace(scale, budget_s=args.budget_s)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_e2e: no CUDA device (use --dry-run to exercise the script on the CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.float16
    out_dir = args.out or Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    timer = Timer(device)
    rows, skipped, notes = [], [], []

    def over_budget(reserve_s: float = 0.0) -> bool:
        return time.perf_counter() - started > scale.budget_s - reserve_s

    prepared = {}
    for name in args.models:
        torch.manual_seed(0)
        model = build(name, scale).eval()
        models, info = prepare_contenders(model, inputs_for(model, 1, 8, "cpu"))
        notes.append(f"{name}: {info['num_rms']} of {info['num_norms']} LayerNorms folded, "
                     f"{info['num_fused']} residual adds fused")
        prepared[name] = (model, {k: m.to(device=device, dtype=dtype) for k, m in models.items()})
        print(f"gpu_e2e: {name} ready ({notes[-1]}), {time.perf_counter() - started:.0f} s", flush=True)

    # every model's eager shapes first: the budget runs out on the least important settings
    modes = [("eager", None), ("cuda graph", None), ("compile", "default"), ("compile+cuda graphs", "reduce-overhead")]
    for mode, compile_mode in modes:
        for name, (model, models) in prepared.items():
            if compile_mode is not None and name != "gpt2":
                continue
            shapes = ([(b, t) for b in scale.batches for t in scale.seqs] if compile_mode is None
                      else list(scale.compile_shapes))
            if mode == "cuda graph" and device.type != "cuda":
                skipped.append(f"{name} {mode}: needs a CUDA device")
                continue
            if compile_mode is not None:
                torch._dynamo.reset()
                runners = {k: torch.compile(m, mode=compile_mode if device.type == "cuda" else None,
                                            backend="inductor" if device.type == "cuda" else "eager")
                           for k, m in models.items()}
            else:
                runners = models
            for batch, seq in shapes:
                # compiling three contenders takes minutes on a cold cache: start only with time to finish
                if over_budget(scale.compile_reserve_s if compile_mode is not None else 0.0):
                    skipped.append(f"{name} {mode} batch {batch} seq {seq}: over the {scale.budget_s:.0f} s budget")
                    continue
                row = time_shape(name, mode, runners, model, batch, seq, device, dtype, scale, timer, skipped)
                if row is not None:
                    rows.append(row)
    write(rows, skipped, notes, out_dir, device, dtype, args, started)
    return 0


def time_shape(name, mode, runners, model, batch, seq, device, dtype, scale, timer, skipped) -> dict | None:
    """One table row: every contender at (batch, seq); a contender that fails is reported in the row."""
    from normfold.bench import ratio_ci

    kwargs = inputs_for(model, batch, seq, device)
    calls, failed = {}, []
    with torch.no_grad():
        for k, m in runners.items():
            try:
                if mode == "cuda graph":
                    calls[k] = cuda_graph_call(m, kwargs)
                else:
                    calls[k] = lambda m=m: m(**kwargs)
                    calls[k]()  # compilation (if any) outside the timed region
            except Exception as exc:  # a contender that cannot run here is reported, not fatal
                calls.pop(k, None)
                failed.append(f"{k}: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
        if "original" not in calls:
            skipped.append(f"{name} {mode} batch {batch} seq {seq}: original failed ({failed})")
            return None
        times = measure(calls, scale, timer)
    row = {"model": name, "mode": mode, "dtype": str(dtype).replace("torch.", ""), "batch": batch, "seq": seq,
           "original_ms": round(statistics.median(times["original"]) * 1e3, 4)}
    for k in CONTENDERS[1:]:
        if k in times:
            point, low, high = ratio_ci(times["original"], times[k], resamples=1000, confidence=0.95)
            row.update({f"{k}_ms": round(statistics.median(times[k]) * 1e3, 4), f"{k}_speedup": round(point, 4),
                        f"{k}_ci": f"[{low:.3f}, {high:.3f}]"})
        else:
            row.update({f"{k}_ms": "", f"{k}_speedup": "", f"{k}_ci": "failed"})
    row["failures"] = "; ".join(failed)
    print(f"  {name} {mode:20s} b{batch} t{seq}: original {row['original_ms']:.3f} ms, fused "
          f"{row['fused_speedup']}x {row['fused_ci']}", flush=True)
    return row


def write(rows, skipped, notes, out_dir: Path, device, dtype, args, started) -> None:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(out_dir / "gpu_e2e.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, columns)
        writer.writeheader()
        writer.writerows(rows)
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})"
    lines = ["# GPU end-to-end: original vs folded vs folded+fused", "",
             f"command: `bash benchmarks/gpu_e2e.sh {shlex.join(sys.argv[1:] if argv_is_cli() else [])}`", "",
             f"hardware: {hardware}; dtype {str(dtype).replace('torch.', '')}; torch {torch.__version__}; "
             f"wall {time.perf_counter() - started:.0f} s" + ("; DRY RUN: timings meaningless" if args.dry_run else ""),
             "", *[f"- {n}" for n in notes], "",
             "speedup = original median / contender median (> 1 is faster), 95% bootstrap CI", "",
             "| model | mode | batch | seq | original ms | folded | fused | failures |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['mode']} | {r['batch']} | {r['seq']} | {r['original_ms']} | "
                     f"{r['folded_speedup']} {r['folded_ci']} | {r['fused_speedup']} {r['fused_ci']} | {r['failures']} |")
    if skipped:
        lines += ["", "Skipped:", *[f"- {s}" for s in skipped]]
    (out_dir / "gpu_e2e.md").write_text("\n".join(lines) + "\n")
    print(f"gpu_e2e: wrote {out_dir / 'gpu_e2e.csv'} and {out_dir / 'gpu_e2e.md'}")


def argv_is_cli() -> bool:
    return Path(sys.argv[0]).name == "gpu_e2e.py"


if __name__ == "__main__":
    raise SystemExit(main())
