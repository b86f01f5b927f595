"""Train the bundled default model: a small Pre-LN GPT-2 on text that ships with CPython.

    nice -n 10 .venv/bin/python scripts/train_default_model.py            # ~4 min on 2 idle cores (13 min shared)
    nice -n 10 .venv/bin/python scripts/train_default_model.py --minutes 1 --out /tmp/m   # quick try

The corpus is ``pydoc_data.topics`` (the help texts behind ``help("if")`` etc.), joined in sorted
key order and read as raw UTF-8 bytes. The vocabulary is the 256 byte values, so the model needs
no tokenizer file and no download: token id = byte value. The last 10% of the bytes are held out
for validation. The text differs a little between Python versions, so its SHA-256 is recorded.

Everything is seeded and ``torch.use_deterministic_algorithms(True)`` is on; the thread count is
fixed because CPU reductions can change order with it. Training stops after ``--steps`` or after
``--minutes`` of wall time, whichever comes first (the step budget is what makes it reproducible;
the time limit only protects a shared machine).

The result is saved with ``save_pretrained(safe_serialization=True)`` in float32: the model is
small (about 3.4 MB), and keeping float32 means the folded model can be compared with the
original at float32 precision instead of at fp16 rounding, which is what the demo shows.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "src" / "normfold" / "data" / "default_model"


@dataclass
class TrainConfig:
    n_layer: int = 4            # enough blocks for a residual stream worth folding (9 LayerNorms)
    n_embd: int = 128           # 4 layers x 128 wide = 0.84M parameters = 3.4 MB in float32 (budget 8 MB)
    n_head: int = 4             # 32-dim heads
    n_positions: int = 128      # context length; byte-level text needs some context to beat unigrams
    vocab_size: int = 256       # one token per byte value: no tokenizer needed
    batch_size: int = 16        # 16 x 128 = 2048 bytes per step
    steps: int = 250            # the reproducible budget: 0.5M bytes, ~1.2 passes over the training split
    lr: float = 3e-3            # small model, AdamW; cosine decay to lr/10 after a short warmup
    warmup: int = 50
    weight_decay: float = 0.1
    val_fraction: float = 0.1   # the last 10% of the bytes
    seed: int = 0
    threads: int = 2            # fixed: the reduction order (and so the bits) can depend on it


def corpus_bytes() -> bytes:
    """The training text: every pydoc topic, in sorted key order, as UTF-8."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "".join(topics[k] for k in sorted(topics)).encode("utf-8")


def unigram_entropy(data: torch.Tensor) -> float:
    """Entropy in nats/byte of the byte frequencies: what a model with no context can reach."""
    p = torch.bincount(data, minlength=256).double() / data.numel()
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def batch(data: torch.Tensor, cfg: TrainConfig, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, data.numel() - cfg.n_positions - 1, (cfg.batch_size,), generator=gen)
    window = torch.stack([data[s: s + cfg.n_positions + 1] for s in starts.tolist()])  # (B, T+1)
    return window[:, :-1], window[:, 1:]


@torch.no_grad()
def evaluate(model, data: torch.Tensor, cfg: TrainConfig) -> float:
    """Mean next-byte cross-entropy (nats/byte) over non-overlapping windows of the split."""
    model.eval()
    n = (data.numel() - 1) // cfg.n_positions
    x = data[: n * cfg.n_positions].view(n, cfg.n_positions)
    y = data[1: n * cfg.n_positions + 1].view(n, cfg.n_positions)
    total = 0.0
    for i in range(0, n, 64):
        logits = model(input_ids=x[i: i + 64], use_cache=False).logits  # (b, T, 256)
        total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y[i: i + 64].flatten(), reduction="sum"))
    model.train()
    return total / y.numel()


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--minutes", type=float, default=60.0, help="wall-time cap (default 60)")
    args = parser.parse_args(argv)

    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = TrainConfig(steps=args.steps)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)

    raw = corpus_bytes()
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    n_val = int(len(data) * cfg.val_fraction)
    train, val = data[:-n_val], data[-n_val:]

    config = GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.n_positions, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
        n_head=cfg.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # too short a run to need dropout
        bos_token_id=0, eos_token_id=0, tie_word_embeddings=True,
    )
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)

    t0 = time.perf_counter()
    steps_done = 0
    for step in range(cfg.steps):
        if time.perf_counter() - t0 > args.minutes * 60:
            print(f"time cap reached after {step} steps", flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = batch(train, cfg, gen)
        logits = model(input_ids=x, use_cache=False).logits  # (B, T, 256)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps_done = step + 1
        if step % 100 == 0:
            print(f"step {step:5d}  train loss {loss.item():.3f}  {time.perf_counter() - t0:6.0f} s", flush=True)
    train_seconds = time.perf_counter() - t0

    val_loss = evaluate(model, val, cfg)
    metrics = {
        "val_loss_nats_per_byte": round(val_loss, 4),
        "val_bits_per_byte": round(val_loss / math.log(2), 4),
        "val_perplexity": round(math.exp(val_loss), 3),
        "val_unigram_entropy_nats_per_byte": round(unigram_entropy(val), 4),
        "steps": steps_done,
        "train_seconds": round(train_seconds, 1),
        "train_config": asdict(cfg),
        "corpus": "pydoc_data.topics, sorted keys, UTF-8 bytes",
        "corpus_bytes": len(raw),
        "corpus_sha256": hashlib.sha256(raw).hexdigest(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "command": "nice -n 10 .venv/bin/python scripts/train_default_model.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()}, {cfg.threads} threads",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    (args.out / "training.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (args.out / "README.md").write_text(_readme(metrics))
    print(json.dumps({k: v for k, v in metrics.items() if k != "train_config"}, indent=2))
    return 0


def _readme(m: dict) -> str:
    c = m["train_config"]
    return f"""# normfold default model

A small Pre-LN GPT-2 (`GPT2LMHeadModel`: {c['n_layer']} layers, width {c['n_embd']}, {c['n_head']} heads,
context {c['n_positions']}, tied embeddings) trained on the bytes of CPython's `pydoc_data.topics`
(Python {m['python']}, {m['corpus_bytes']} bytes, sha256 `{m['corpus_sha256'][:16]}…`).
Vocabulary: the 256 byte values (token id = byte), so no tokenizer is needed:

```python
ids = torch.tensor([list("def f(x):".encode())])
```

| held-out split (last 10%) | value |
|---|---|
| loss | {m['val_loss_nats_per_byte']} nats/byte ({m['val_bits_per_byte']} bits/byte) |
| perplexity | {m['val_perplexity']} |
| unigram entropy of the split (no-context baseline) | {m['val_unigram_entropy_nats_per_byte']} nats/byte |

Trained for {m['steps']} steps in {m['train_seconds']} s ({m['machine']}, torch {m['torch']}), float32 weights:

    {m['command'].strip()}

It exists so that `normfold demo` has a real trained model to fold on a machine with no download.
"""


if __name__ == "__main__":
    raise SystemExit(main())
