"""Does rotating the residual stream (``normfold.rotate``) help quantization or slicing at this scale?

Rotation (QuaRot, SpinQuant) pays off where activations have *outlier features*: a few channels of
the residual stream far larger than the rest, which make round-to-nearest quantization lose the
small ones. An orthogonal Q spreads them over every channel. SliceGPT's PCA basis puts the
stream's energy into the leading directions so the last ones can be deleted. Both need large
trained models to show; this script measures two small ones honestly:

- the bundled byte-level GPT-2 (4 × 128, tied embeddings), and
- a larger byte-level GPT (4 × 256, untied) trained here, deterministically (seed 0), with
  ``normfold.train`` on the same corpus as the other experiments (CPython's pydoc topics).

For each model and each basis (none; the exact fold alone; "hadamard", "random", "pca"):
(a) outlier statistics per layer: kurtosis and max|x|/rms of every token's row of the stream (the
    norms' inputs) and of every linear layer's input; (b) validation loss after quantization:
    round-to-nearest fake-quant W4 (per output channel, and groups of 128), W4A8 (W4 per channel,
    8-bit per-token activations), and torchao's W8A8 (int8 weights, dynamic int8 activations) when
    torchao is installed (``pip install torchao``; not a normfold dependency); (c) validation loss
    after slicing 10/20/30% of the stream with "pca".
Quantized: every linear layer of the blocks; embeddings and the output head stay in float32 (as
QuaRot and GPTQ keep them). Validation: the first ``--val-windows`` non-overlapping 128-byte
windows of the held-out last 10% of the corpus.

    python experiments/rotation.py                                    # both models (timings: results/rotation.md)
    python experiments/rotation.py --model-cache /tmp/rotation_cache  # keep the trained model for the next run
    python experiments/rotation.py --quick                            # a tiny trained model only, smoke run
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from _common import RESULTS, Stopwatch, command_line, machine, markdown_table, pyplot, write_csv

import normfold
from normfold.nn.kinds import norm_modules
from normfold.train import GPT, resolve_config, train
from normfold.train.checkpoint import to_gpt2
from normfold.train.data import TokenSplits, encode, load_text

# The larger model: 2× the bundled model's width, what ~12 minutes of training on 2 shared cores
# allow (a 6 × 256 model ran at ~370 tokens/s under load 6: too slow for a useful budget).
LARGER = dict(n_layer=4, n_embd=256, n_head=8, block_size=128, tie_embeddings=False, seed=0, batch_size=16,
              max_steps=200, lr=3e-3, min_lr=3e-4, warmup_steps=40, eval_interval=50, eval_iters=10)
QUICK = dict(n_layer=2, n_embd=64, n_head=2, block_size=128, tie_embeddings=False, seed=0, batch_size=8,
             max_steps=30, lr=3e-3, min_lr=3e-4, warmup_steps=5, eval_interval=15, eval_iters=2)


def trained_model(setup: dict, cache: Path | None) -> tuple[GPT, dict]:
    """The larger GPT, trained from ``setup`` (seeded: the same weights every time), or read from
    ``cache`` when a previous run with the same setup left it there."""
    key = json.dumps(setup, sort_keys=True)
    cached = cache / "rotation_model.pt" if cache is not None else None
    if cached is not None and cached.is_file():
        saved = torch.load(cached, weights_only=True)
        if saved["setup"] == key:
            model = GPT(resolve_config(**setup).model)
            model.load_state_dict(saved["state"])
            return model.eval(), saved["summary"]
    with tempfile.TemporaryDirectory(prefix="normfold_rotation_") as scratch:
        config = resolve_config(out_dir=scratch, progress=False, save_checkpoint=False, **setup)
        torch.manual_seed(config.seed)
        model = GPT(config.model)
        summary = train(config, model, overwrite=True)
    summary = {k: summary[k] for k in ("num_parameters", "steps", "tokens", "train_time_s", "final_val_loss")}
    if cached is not None:
        cache.mkdir(parents=True, exist_ok=True)
        torch.save({"setup": key, "state": model.state_dict(), "summary": summary}, cached)
    return model.eval(), summary


# ---------------------------------------------------------------- the two models, one interface


@dataclass
class Subject:
    """A model under test: float32, eval mode, output head untied from the embedding (the same
    function; SliceGPT cannot slice a table that both writes and reads the stream)."""

    name: str
    model: nn.Module
    call: Callable[[Tensor], object]  # token ids -> the model's call (args tuple or kwargs dict)
    about: str


def untie_output_head(model: nn.Module) -> nn.Module:
    """A Hugging Face model's output head gets its own copy of a tied embedding table (outputs unchanged)."""
    head = model.lm_head
    for embedding in model.modules():
        if isinstance(embedding, nn.Embedding) and embedding.weight is head.weight:
            head.weight = nn.Parameter(embedding.weight.detach().clone())
    model.config.tie_word_embeddings = False
    return model


def gpt2_call(ids: Tensor) -> dict:
    return {"input_ids": ids, "use_cache": False}


def bundled_subject() -> Subject:
    from transformers import GPT2LMHeadModel  # not at the top: an optional dependency (normfold[hf])

    from normfold.hf.load import default_model_path

    model = untie_output_head(GPT2LMHeadModel.from_pretrained(default_model_path()).eval())
    return Subject("bundled 4×128", model, gpt2_call,
                   "the bundled GPT-2 (4 layers × 128, 250 steps; see src/normfold/data/default_model)")


def as_untied_gpt2(model: GPT) -> nn.Module:
    """The trained GPT as a Hugging Face ``GPT2LMHeadModel`` with its own output head (checked to
    give the same logits). Slicing needs it: Hugging Face's attention takes its head sizes from the
    config, this GPT's from the stream's width, which slicing shrinks."""
    tied_view = copy.copy(model)  # to_gpt2 converts tied models: convert as tied, then give the head back
    tied_view.config = dataclasses.replace(model.config, tie_embeddings=True)
    hf = to_gpt2(tied_view)
    hf.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    hf.config.tie_word_embeddings = False
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (hf.eval()(ids).logits - model(ids)[0]).abs().max().item()
    assert gap < 1e-4, f"the Hugging Face copy of the trained GPT differs by {gap}"
    return hf


def trained_subject(setup: dict, cache: Path | None) -> tuple[Subject, dict]:
    model, summary = trained_model(setup, cache)
    name = f"trained {setup['n_layer']}×{setup['n_embd']}"
    about = (f"GPT {setup['n_layer']} layers × {setup['n_embd']}, {setup['n_head']} heads, trained here: "
             f"{summary['steps']} steps × {setup['batch_size']} × {setup['block_size']} bytes "
             f"({summary['tokens']:,} tokens, {summary['train_time_s']:.0f} s), seed {setup['seed']}, lr {setup['lr']}")
    return Subject(name, as_untied_gpt2(model), gpt2_call, about), summary


def run_call(model: nn.Module, call) -> object:
    return model(**call) if isinstance(call, dict) else model(*call)


def logits_of(model: nn.Module, subject: Subject, ids: Tensor) -> Tensor:
    return run_call(model, subject.call(ids)).logits


# ---------------------------------------------------------------- data


def corpus_splits(block_size: int) -> TokenSplits:
    """The experiments' corpus, split as in training: the last 10% is validation."""
    return TokenSplits(encode(load_text([])), block_size, 0.1)


def validation_windows(splits: TokenSplits, count: int) -> tuple[Tensor, Tensor]:
    """The first ``count`` non-overlapping windows of the validation split: inputs and next bytes."""
    t = splits.block_size
    available = (len(splits.val) - 1) // t
    if not 0 < count <= available:
        raise ValueError(f"--val-windows must be in [1, {available}], got {count}")
    x = splits.val[: count * t].view(count, t)
    y = splits.val[1: count * t + 1].view(count, t)
    return x, y


def calibration_ids(splits: TokenSplits, calls: int, batch: int, seed: int = 1234) -> list[Tensor]:
    """Seeded random training windows for calibration (never validation text)."""
    generator = torch.Generator().manual_seed(seed)
    return [splits.batch("train", batch, generator)[0] for _ in range(calls)]


def window_losses(model: nn.Module, subject: Subject, data: tuple[Tensor, Tensor], batch: int = 16) -> Tensor:
    """Mean cross-entropy (nats/byte) of each validation window."""
    x, y = data
    losses = []
    with torch.no_grad():
        for start in range(0, len(x), batch):
            logits = logits_of(model, subject, x[start: start + batch]).float()
            per_token = nn.functional.cross_entropy(logits.transpose(1, 2), y[start: start + batch], reduction="none")
            losses.append(per_token.mean(dim=1))
    return torch.cat(losses)


def paired_difference(a: Tensor, b: Tensor) -> tuple[float, float]:
    """mean(a − b) over windows and the half-width of its 95% interval (1.96 standard errors)."""
    d = (a - b).double()
    return d.mean().item(), 1.96 * d.std().item() / math.sqrt(len(d)) if len(d) > 1 else float("nan")


# ---------------------------------------------------------------- (a) outlier statistics


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every Linear / Hugging Face Conv1D, by path (the output head included)."""
    return {path: m for path, m in model.named_modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"}


def row_statistics(x: Tensor) -> dict[str, float]:
    """Outlier statistics of the rows (tokens) x (N, d), float64.

    kurtosis: per row E[(x−μ)⁴]/σ⁴ (3 for a Gaussian; outlier features give tens to hundreds),
    averaged over rows; max|x|/rms: per row max_i |x_i| / √(mean x²) (√d at most), mean and max
    over rows; channel ratio: the largest channel's RMS over all rows divided by the median
    channel's (an outlier *feature* is a channel large in every token).
    """
    x = x.double().reshape(-1, x.shape[-1])
    centered = x - x.mean(dim=1, keepdim=True)
    variance = centered.pow(2).mean(dim=1)
    kurtosis = centered.pow(4).mean(dim=1) / variance.clamp_min(1e-300).pow(2)
    peak = x.abs().amax(dim=1) / x.pow(2).mean(dim=1).sqrt().clamp_min(1e-300)
    channel_rms = x.pow(2).mean(dim=0).sqrt()
    return {"kurtosis": kurtosis.mean().item(), "max_over_rms_mean": peak.mean().item(),
            "max_over_rms_max": peak.max().item(),
            "channel_ratio": (channel_rms.max() / channel_rms.median().clamp_min(1e-300)).item()}


def site_statistics(model: nn.Module, subject: Subject, ids: Tensor, readers: set[str]) -> list[dict]:
    """Outlier statistics of the stream (every norm's input) and of every linear layer's input."""
    sites = {path: "stream" for path, _, _ in norm_modules(model)}
    sites |= {path: "reader input" if path in readers else "other linear input" for path in linear_layers(model)}
    captured: dict[str, list[Tensor]] = {path: [] for path in sites}
    hooks = [model.get_submodule(path).register_forward_pre_hook(
        lambda module, inputs, path=path: captured[path].append(inputs[0].detach())) for path in sites]
    try:
        with torch.no_grad():
            run_call(model, subject.call(ids))
    finally:
        for hook in hooks:
            hook.remove()
    return [dict(site=path, kind=kind, **row_statistics(torch.cat(captured[path])))
            for path, kind in sites.items()]


# ---------------------------------------------------------------- (b) quantization


def fake_quantize(t: Tensor, bits: int, dim: int, group: int | None = None) -> Tensor:
    """Symmetric round-to-nearest along ``dim``: t ≈ s·clamp(round(t/s), −2^(b−1), 2^(b−1) − 1),
    one scale s = max|t|/(2^(b−1) − 1) per group of ``group`` entries (the whole dim when None or
    larger than the dim)."""
    x = t.movedim(dim, -1)
    size = x.shape[-1]
    group = min(group or size, size)
    if size % group:
        raise ValueError(f"a dim of {size} does not split into groups of {group}")
    grouped = x.reshape(*x.shape[:-1], size // group, group)
    qmax = 2 ** (bits - 1) - 1
    scale = grouped.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / qmax
    quantized = (grouped / scale).round().clamp(-qmax - 1, qmax) * scale
    return quantized.reshape(x.shape).movedim(-1, dim)


def quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The linear layers quantization touches: all but the output head (kept in float32)."""
    return {path: m for path, m in linear_layers(model).items() if path != "lm_head"}


def input_dim(module: nn.Module) -> int:
    return 0 if type(module).__name__ == "Conv1D" else 1  # Conv1D's weight is (in, out), Linear's (out, in)


def weight_quantized(model: nn.Module, bits: int, group: int | None) -> nn.Module:
    """A copy whose quantized layers' weights are fake-quantized per output channel (``group``
    None) or per group of input entries."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for module in quantized_layers(model).values():
            module.weight.copy_(fake_quantize(module.weight, bits, input_dim(module), group))
    return model


def activation_quantized(model: nn.Module, bits: int) -> nn.Module:
    """``model`` (in place) with every quantized layer's input fake-quantized per token (dynamic)."""
    for module in quantized_layers(model).values():
        module.register_forward_pre_hook(lambda m, inputs: (fake_quantize(inputs[0], bits, -1), *inputs[1:]))
    return model


def conv1d_as_linear(model: nn.Module) -> nn.Module:
    """Hugging Face Conv1D layers (y = x·W + b, W (in, out)) replaced by equal nn.Linear ones, which
    torchao quantizes."""
    for path, module in list(linear_layers(model).items()):
        if type(module).__name__ == "Conv1D":
            linear = nn.Linear(*module.weight.shape)
            with torch.no_grad():
                linear.weight.copy_(module.weight.T)
                linear.bias.copy_(module.bias)
            model.set_submodule(path, linear)
    return model


def torchao_quantized(model: nn.Module, config_name: str) -> nn.Module:
    """A copy quantized by torchao (``quantize_``), the output head excepted."""
    from torchao import quantization  # not at the top: an optional dependency of this script only

    config = getattr(quantization, config_name)()
    model = conv1d_as_linear(copy.deepcopy(model))
    quantization.quantize_(model, config, filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn != "lm_head")
    return model


def torchao_available() -> str | None:
    """torchao's version when it imports and quantizes a Linear on this CPU, else None."""
    try:
        import torchao
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

        probe = nn.Sequential(nn.Linear(32, 32))
        quantize_(probe, Int8DynamicActivationInt8WeightConfig())
        with torch.no_grad():
            probe(torch.randn(2, 32))
        return torchao.__version__
    except Exception:  # noqa: BLE001 - any failure means: skip torchao, and say so
        return None


SCHEMES: dict[str, Callable[[nn.Module], nn.Module]] = {
    "float32": lambda m: m,
    "W4 per-channel": lambda m: weight_quantized(m, 4, None),
    "W4 g128": lambda m: weight_quantized(m, 4, 128),
    "W4A8": lambda m: activation_quantized(weight_quantized(m, 4, None), 8),
}
TORCHAO_SCHEMES = {"torchao W8A8": "Int8DynamicActivationInt8WeightConfig"}  # int8 weights, dynamic int8 activations


# ---------------------------------------------------------------- the bases

BASES = ("original", "fold", "hadamard", "random", "pca")
SLICES = (0.1, 0.2, 0.3)


def transformed(subject: Subject, basis: str, example: Tensor, calibration: list[Tensor],
                slice_fraction: float = 0.0) -> tuple[nn.Module, dict]:
    """The model in ``basis`` ("original", the exact "fold" alone, or a ``normfold.rotate`` method),
    and what its report says (the float64 proof, the basis, slicing's kept energy and cosine)."""
    call = subject.call(example)
    if basis == "original":
        return subject.model, {}
    if basis == "fold":
        folded, report = normfold.fold(subject.model, call)
        return folded, {"proof_max_rel_error": report.verification.max_rel_error}
    kwargs = {"calibration": [subject.call(ids) for ids in calibration]} if basis == "pca" else {}
    rotated, report = normfold.rotate(subject.model, call, method=basis, seed=0, slice_fraction=slice_fraction,
                                      **kwargs)
    stream = report.streams[0]
    info = {"how": stream.how, "proof_max_rel_error": report.verification.max_rel_error,
            "orthogonality_error": stream.orthogonality_error, "streams": len(report.streams),
            "readers": {t.fqn.rpartition(".")[0] for s in report.streams for t in s.stream.tensors
                        if "reader" in t.role}}
    if report.slicing is not None:
        info |= {"kept": stream.kept, "width": stream.stream.width, "kept_energy": stream.kept_energy,
                 "calibration_min_cosine": report.slicing.agreement.min_cosine}
    return rotated, info


# ---------------------------------------------------------------- one model, every measurement


def measure(subject: Subject, splits: TokenSplits, args, schemes: dict[str, Callable[[nn.Module], nn.Module]],
            log: Callable[[str], None]) -> dict[str, list[dict]]:
    torch.manual_seed(0)
    data = validation_windows(splits, args.val_windows)
    calibration = calibration_ids(splits, args.calibration_calls, 4)
    example = data[0][:2, :32]
    stats_ids = data[0][: args.stats_windows]
    models, infos = {}, {}
    for basis in BASES:
        clock = time.perf_counter()
        models[basis], infos[basis] = transformed(subject, basis, example, calibration)
        log(f"{subject.name}: {basis} ready in {time.perf_counter() - clock:.0f} s")
    readers = infos["hadamard"]["readers"]
    outliers = [dict(model=subject.name, basis=basis, **row)
                for basis, model in models.items() for row in site_statistics(model, subject, stats_ids, readers)]
    losses, baseline = [], {}
    for scheme, make in schemes.items():
        for basis, model in models.items():
            per_window = window_losses(make(model), subject, data)
            baseline.setdefault(scheme, per_window)  # "original" comes first
            delta, half_width = paired_difference(per_window, baseline[scheme])
            losses.append(dict(model=subject.name, scheme=scheme, basis=basis, val_loss=per_window.mean().item(),
                               delta_vs_original=delta, delta_ci95=half_width))
        log(f"{subject.name}: {scheme} done")
    sliced = [dict(model=subject.name, fraction=0.0, kept=None, kept_energy=1.0, calibration_min_cosine=1.0,
                   val_loss=[r for r in losses if r["scheme"] == "float32" and r["basis"] == "pca"][0]["val_loss"],
                   delta_vs_unsliced=0.0, delta_ci95=0.0)]
    unsliced = window_losses(models["pca"], subject, data)
    for fraction in SLICES:
        model, info = transformed(subject, "pca", example, calibration, fraction)
        per_window = window_losses(model, subject, data)
        delta, half_width = paired_difference(per_window, unsliced)
        sliced.append(dict(model=subject.name, fraction=fraction, kept=f"{info['kept']}/{info['width']}",
                           kept_energy=info["kept_energy"], calibration_min_cosine=info["calibration_min_cosine"],
                           val_loss=per_window.mean().item(), delta_vs_unsliced=delta, delta_ci95=half_width))
        log(f"{subject.name}: sliced {fraction:.0%}")
    proofs = [dict(model=subject.name, basis=basis, **{k: v for k, v in info.items() if k != "readers"})
              for basis, info in infos.items() if basis != "original"]
    return {"outliers": outliers, "losses": losses, "slicing": sliced, "proofs": proofs}


# ---------------------------------------------------------------- report

OUTLIER_RULE = 10.0  # "outlier features": some site's largest channel RMS ≥ 10× its median channel's


def outlier_summary(rows: list[dict]) -> list[dict]:
    """Per model, basis and kind of site: kurtosis (mean and max over sites), the worst max|x|/rms
    and the worst channel ratio."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["basis"], row["kind"]), []).append(row)
    return [dict(model=model, basis=basis, kind=kind, sites=len(group),
                 kurtosis_mean=sum(r["kurtosis"] for r in group) / len(group),
                 kurtosis_max=max(r["kurtosis"] for r in group),
                 max_over_rms_max=max(r["max_over_rms_max"] for r in group),
                 channel_ratio_max=max(r["channel_ratio"] for r in group))
            for (model, basis, kind), group in groups.items()]


def outlier_verdict(summary: list[dict], model: str) -> str:
    original = [r for r in summary
                if r["model"] == model and r["basis"] == "original" and r["kind"] != "other linear input"]
    ratio = max(r["channel_ratio_max"] for r in original)
    kurtosis = max(r["kurtosis_max"] for r in original)
    has = ratio >= OUTLIER_RULE
    return (f"**{model}: {'outlier features' if has else 'no outlier features'}** (rule: some channel's RMS "
            f"≥ {OUTLIER_RULE:.0f}× the median channel's, on the stream or a reader's input): largest channel ratio "
            f"{ratio:.1f}×, largest per-token kurtosis {kurtosis:.1f} (a Gaussian's is 3).")


def quantization_findings(losses: list[dict], model: str) -> list[str]:
    """One line per scheme: how each basis moves the loss against the original, with its interval."""
    lines = []
    for scheme in dict.fromkeys(r["scheme"] for r in losses if r["model"] == model):
        rows = {r["basis"]: r for r in losses if r["model"] == model and r["scheme"] == scheme}
        if scheme == "float32":
            continue
        parts = []
        for basis in BASES[1:]:
            r = rows[basis]
            significant = abs(r["delta_vs_original"]) > r["delta_ci95"]
            parts.append(f"{basis} {r['delta_vs_original']:+.4f} ± {r['delta_ci95']:.4f}"
                         + ("" if significant else " (n.s.)"))
        lines.append(f"- {model}, {scheme}: original {rows['original']['val_loss']:.4f} → change: "
                     + "; ".join(parts))
    return lines


def fmt(value, digits: int = 4) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def scientific(value: float | None) -> str:
    return "—" if value is None else f"{value:.1e}"


def write_markdown(path: Path, results: dict[str, list[dict]], subjects: list[Subject], torchao: str | None,
                   args, elapsed: str) -> None:
    summary = outlier_summary(results["outliers"])
    losses, sliced, proofs = results["losses"], results["slicing"], results["proofs"]
    names = [s.name for s in subjects]
    schemes = list(dict.fromkeys(r["scheme"] for r in losses))
    text = [f"# Rotation at small scale: outliers, quantization, slicing\n",
            f"Command: `{command_line()}`  ",
            f"Machine: {machine()}  ",
            f"Whole run: {elapsed}. Validation: the first {args.val_windows} windows of 128 bytes of the held-out "
            f"split; statistics on the first {args.stats_windows}; PCA calibration: {args.calibration_calls} × 4 "
            f"seeded training windows of 128 bytes.  ",
            "torchao: " + (f"{torchao} (int8 rows below)" if torchao else "not installed or not working here: its "
                           "rows are skipped") + "\n",
            "Models:", *[f"- **{s.name}**: {s.about}" for s in subjects], "",
            "Every rotation below is exact before quantization (float64 proof of `normfold.rotate`):", "",
            markdown_table(["model", "basis", "how", "float64 max rel err", "max|QᵀQ − I|"],
                           [[p["model"], p["basis"], p.get("how", "exact fold, no rotation"),
                             f"{p['proof_max_rel_error']:.1e}", scientific(p.get("orthogonality_error"))]
                            for p in proofs]), "",
            "## (a) Outlier features", "",
            *[outlier_verdict(summary, name) + "  " for name in names], "",
            "Per kind of site (stream: every norm's input; reader input: the linear layers reading a stream norm, "
            "which a rotation changes; other linear input: attention output and MLP hidden, which it does not). "
            "Kurtosis per token row, mean and max over the sites; max|x|/rms per token row, worst; channel ratio: "
            "largest channel RMS / median channel RMS, worst. Per layer: `rotation_outliers.csv`.", "",
            markdown_table(["model", "basis", "site", "n", "kurtosis mean", "kurtosis max", "max|x|/rms",
                            "channel ratio"],
                           [[r["model"], r["basis"], r["kind"], r["sites"], fmt(r["kurtosis_mean"], 2),
                             fmt(r["kurtosis_max"], 2), fmt(r["max_over_rms_max"], 2), fmt(r["channel_ratio_max"], 2)]
                            for r in summary]), "",
            "## (b) Quantization: validation loss (nats/byte)", "",
            "Round-to-nearest, symmetric: W4 per output channel, W4 in groups of 128 input entries, W4A8 (W4 per "
            "channel, activations 8-bit per token, dynamic). Every linear layer of the blocks; embeddings and the "
            "output head stay float32. Change: paired mean over the validation windows against the original model "
            "under the same scheme, ± its 95% interval; n.s.: the interval includes 0.", ""]
    for name in names:
        rows = {(r["scheme"], r["basis"]): r for r in losses if r["model"] == name}
        text += [f"**{name}**", "", markdown_table(["scheme", *BASES],
                 [[scheme, *[fmt(rows[(scheme, b)]["val_loss"]) for b in BASES]] for scheme in schemes]), ""]
    text += [line for name in names for line in quantization_findings(losses, name)] + [""]
    text += ["## (c) Slicing with the PCA basis", "",
             "The stream's least used directions deleted (SliceGPT); validation loss against the unsliced PCA "
             "rotation (which equals the original exactly). SliceGPT reports, qualitatively, that large models "
             "(OPT, Llama-2, Phi-2) lose little at 10–20% slicing and more from 30%, and that the loss grows faster "
             "for smaller models.", "",
             markdown_table(["model", "sliced", "kept", "calibration energy kept", "calibration min cosine",
                             "val loss", "change ± 95%"],
                            [[r["model"], f"{r['fraction']:.0%}", r["kept"] or "all", fmt(r["kept_energy"]),
                              fmt(r["calibration_min_cosine"]), fmt(r["val_loss"]),
                              f"{r['delta_vs_unsliced']:+.4f} ± {r['delta_ci95']:.4f}"] for r in sliced]), "",
             "![rotation](" + path.with_suffix(".png").name + ")", ""]
    path.write_text("\n".join(text))


def plot(path: Path, results: dict[str, list[dict]], names: list[str]) -> None:
    plt = pyplot()
    losses, sliced = results["losses"], results["slicing"]
    schemes = list(dict.fromkeys(r["scheme"] for r in losses))
    fig, axes = plt.subplots(1, len(names) + 1, figsize=(6 * len(names) + 5, 4.5))
    width = 0.8 / len(BASES)
    for ax, name in zip(axes, names):
        rows = {(r["scheme"], r["basis"]): r["val_loss"] for r in losses if r["model"] == name}
        for i, basis in enumerate(BASES):
            ax.bar([j + i * width for j in range(len(schemes))], [rows[(s, basis)] for s in schemes], width,
                   label=basis)
        low = min(rows.values())
        ax.set_ylim(low - 0.05, max(rows.values()) + 0.05)
        ax.ticklabel_format(axis="y", useOffset=False)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(schemes))])
        ax.set_xticklabels([s.replace("torchao ", "torchao\n").replace(" + ", "+\n") for s in schemes], fontsize=7)
        ax.set_title(f"{name}: quantized validation loss")
        ax.set_ylabel("nats/byte")
        ax.legend(fontsize=7)
    ax = axes[-1]
    for name in names:
        rows = [r for r in sliced if r["model"] == name]
        ax.plot([100 * r["fraction"] for r in rows], [r["val_loss"] for r in rows], marker="o", label=name)
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.set_xlabel("stream directions sliced (%)")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title("slicing with the PCA basis")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only a tiny trained model, few windows (smoke run)")
    parser.add_argument("--val-windows", type=int, default=None, help="validation windows of 128 bytes (default 32)")
    parser.add_argument("--stats-windows", type=int, default=16, help="windows the outlier statistics run on")
    parser.add_argument("--calibration-calls", type=int, default=8, help="PCA calibration calls of 4 windows")
    parser.add_argument("--model-cache", type=Path, default=None,
                        help="folder to keep the trained model in (it is 13 MB, too large for results/)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = parser.parse_args(argv)
    args.val_windows = args.val_windows or (8 if args.quick else 32)
    if args.quick:
        args.stats_windows, args.calibration_calls = min(args.stats_windows, 4), min(args.calibration_calls, 2)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    clock = Stopwatch()
    log = lambda message: print(f"[{clock}] {message}", flush=True)  # noqa: E731
    torchao = torchao_available()
    schemes = dict(SCHEMES)
    if torchao:
        schemes |= {name: (lambda m, c=config: torchao_quantized(m, c)) for name, config in TORCHAO_SCHEMES.items()}
    splits = corpus_splits(128)
    validation_windows(splits, args.val_windows)  # a bad --val-windows fails here, before any training
    def trained() -> Subject:
        subject, _ = trained_subject(QUICK if args.quick else LARGER, args.model_cache)
        log(f"{subject.name}: {subject.about}")
        return subject

    subjects, results = [], {}
    for make_subject in [trained] if args.quick else [bundled_subject, trained]:  # the bundled one needs no training
        subjects.append(make_subject())
        for key, rows in measure(subjects[-1], splits, args, schemes, log).items():
            results.setdefault(key, []).extend(rows)
    stem = "rotation_quick" if args.quick else "rotation"
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{stem}_outliers.csv", results["outliers"])
    write_csv(args.out / f"{stem}_quantization.csv", results["losses"])
    write_csv(args.out / f"{stem}_slicing.csv", results["slicing"])
    plot(args.out / f"{stem}.png", results, [s.name for s in subjects])
    write_markdown(args.out / f"{stem}.md", results, subjects, torchao, args, str(clock))
    log(f"wrote {args.out / stem}.md")


if __name__ == "__main__":
    main()
