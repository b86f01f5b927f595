"""Random-architecture fuzzing of the fold engine: seeded model generator and independent checks.

``generate(seed)`` draws a small random DAG of blocks as plain data (a ``Spec``); ``FuzzModel(spec)``
is one ``nn.Module`` that interprets it, so every model is a real module ``torch.export`` captures.
``check_seed(seed)`` builds the model in float64, folds it with ``normfold.fold`` (every fourth seed
with ``fold_affine=False``) and judges every LayerNorm with checks that do not use the engine:

- claimed foldable: all outputs of the folded model equal the original's (relative error ≤ 1e-9 on
  fresh random inputs) and the RMSNorm that replaced it sees zero-mean rows (|mean|/rms ≤ 1e-9);
  otherwise a *wrong claim* (a bug);
- refused: brute force over the LN's ancestral parameters (those its autograd graph reaches, each tied name on its
  own): center every linear-map parameter the LN input depends on along its output dim, greedily
  drop the ones not needed for a zero-mean LN input, and if the LN input is then zero-mean and every
  model output unchanged, a fold existed: a *missed* fold (not a bug, a gap). Otherwise *confirmed*.
  That oracle is ``centering_oracle.judge_norms`` (all of a model's unfolded norms at once), which
  ``benchmarks/hf_zoo.py`` applies to real models.

The generator knows, for every parameter it creates, which dim is its "output feature" dim (the
centering recipe); the checks use only that and autograd, never the engine's rules.
"""
from __future__ import annotations

import importlib.util
import math
import random
import textwrap
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from centering_oracle import (MEAN_TOL, REL_TOL, NormVerdict, Recorder, brute_force, judge_norms, rel_error,
                              worst_mean_ratio)

BATCH, TIME = 2, 4            # T = 4 lets a Conv2d see the sequence as a 2×2 image
VOCAB = 10                    # token ids in [0, 10); also the width of a tied lm-head output
WIDTHS = (4, 6, 8, 12, 16)    # feature widths: small (fast export) with several divisors (heads, groups)
NUM_CHECK_INPUTS = 3          # fresh random inputs each property is checked on


# --------------------------------------------------------------------------- the spec

@dataclass
class Block:
    """One op of the DAG: reads env entries ``inputs``, appends one entry of width ``width``."""

    op: str
    inputs: tuple[int, ...]
    width: int
    args: dict = field(default_factory=dict)


@dataclass
class Spec:
    seed: int
    in_width: int               # width of the float input x (B, T, in_width); env[0] is x
    blocks: list[Block]
    outputs: tuple[int, ...]    # env indices returned by the model
    ties: list[tuple[str, str]] = field(default_factory=list)  # (block name, block name whose weight it reuses)

    def describe(self) -> str:
        lines = [f"seed {self.seed}: x (B={BATCH}, T={TIME}, C={self.in_width}) is env[0]"]
        for i, b in enumerate(self.blocks):
            lines.append(f"  env[{i + 1}] = b{i}: {b.op}{list(b.inputs)} -> width {b.width} {b.args or ''}")
        for name, source in self.ties:
            lines.append(f"  {name}.weight is tied to {source}.weight")
        lines.append(f"  outputs: env{list(self.outputs)}")
        return "\n".join(lines)


_NORM_KINDS = ("layer_norm", "layer_norm", "layer_norm_no_bias", "layer_norm_plain", "rms_norm_torch",
               "rms_norm_normfold", "group_norm", "batch_norm")
_ACTIVATIONS = ("gelu", "relu", "tanh", "silu")
# op -> relative frequency; LayerNorms and linear maps dominate, since they are what the engine folds
_UNARY_OPS = {"linear": 6, "matmul_param": 1, "conv1d": 2, "conv2d": 1, "add_param": 2, "mul_param": 1,
              "add_embed": 1, "scale": 2, "act": 2, "dropout": 1, "interleave": 1, "heads": 2, "norm": 6,
              "lm_head": 1, "in_place": 2}
_BINARY_OPS = {"add": 4, "sub": 1, "cat": 2, "mul": 1}


def generate(seed: int) -> Spec:
    """A random model spec; the same seed always gives the same spec."""
    rng = random.Random(seed)
    in_width = rng.choice(WIDTHS)
    widths = [in_width]
    blocks: list[Block] = []
    ties: list[tuple[str, str]] = []
    linears: dict[tuple[int, int], list[str]] = {}   # (in, out) -> names of untied Linear blocks
    embeds: dict[int, list[str]] = {}                # width -> names of Embedding blocks

    def pick(width: int | None = None, exclude: int | None = None) -> int | None:
        """An env index, preferring recent entries; of the given width if asked."""
        candidates = [i for i, w in enumerate(widths) if (width is None or w == width) and i != exclude]
        if not candidates:
            return None
        recent = candidates[-3:]
        return rng.choice(recent) if rng.random() < 0.75 else rng.choice(candidates)

    for _ in range(rng.randint(3, 10)):
        name = f"b{len(blocks)}"
        binary = rng.random() < 0.25 and len(widths) > 1
        op = _choose(rng, _BINARY_OPS if binary else _UNARY_OPS)
        i = pick()
        c = widths[i]
        block = None
        if op in ("add", "sub", "mul"):
            j = pick(c, exclude=i)
            if j is not None:
                block = Block(op, (i, j), c)
        elif op == "cat":
            j = pick(exclude=i)
            if j is not None and c + widths[j] <= 32:
                block = Block(op, (i, j), c + widths[j])
        elif op == "linear":
            out = rng.choice(WIDTHS)
            tie = linears.get((c, out)) if rng.random() < 0.3 else None
            block = Block(op, (i,), out, {"bias": rng.random() < 0.7})
            if tie:
                ties.append((name, rng.choice(tie)))
            else:
                linears.setdefault((c, out), []).append(name)
        elif op == "lm_head":  # a Linear(c, VOCAB) sharing its weight with an Embedding(VOCAB, c)
            source = embeds.get(c)
            if source:
                block = Block("linear", (i,), VOCAB, {"bias": False})
                ties.append((name, rng.choice(source)))
        elif op == "matmul_param":
            block = Block(op, (i,), rng.choice(WIDTHS))
        elif op in ("conv1d", "conv2d"):
            kind = rng.choice(("dense", "grouped", "depthwise"))
            out, groups = rng.choice(WIDTHS), 1
            if kind == "depthwise":
                out, groups = c, c
            elif kind == "grouped":
                common = [g for g in range(2, c + 1) if c % g == 0 and out % g == 0 and g < c]
                groups = rng.choice(common) if common else 1
            block = Block(op, (i,), out, {"groups": groups, "kernel": rng.choice((1, 3)), "bias": rng.random() < 0.7})
        elif op == "add_param":
            block = Block(op, (i,), c, {"per_time": rng.random() < 0.5})
        elif op == "mul_param":
            block = Block(op, (i,), c)
        elif op == "add_embed":
            block = Block(op, (i,), c)
            embeds.setdefault(c, []).append(name)
        elif op == "scale":
            block = Block(op, (i,), c, {"value": rng.choice((0.5, 2.0, -1.5)), "divide": rng.random() < 0.3})
        elif op == "act":
            block = Block(op, (i,), c, {"fn": rng.choice(_ACTIVATIONS)})
        elif op == "dropout":
            block = Block(op, (i,), c)
        elif op == "in_place" and not _aliases_input(blocks, i):  # a forward must not change its arguments
            block = Block(op, (i,), c, {"kind": rng.choice(("add_param", "scale", "relu"))})
        elif op == "interleave" and c % 2 == 0:  # a permutation of features through view/transpose/reshape
            block = Block(op, (i,), c)
        elif op == "heads" and c % 2 == 0:
            block = Block(op, (i,), c, {"inner": rng.choice(("scale", "head_ln", "head_ln_plain", "attention")),
                                        "heads": 2})
        elif op == "norm":
            kind = rng.choice(_NORM_KINDS)
            groups = [g for g in range(2, c) if c % g == 0]
            block = Block(op, (i,), c, {"kind": kind, "groups": rng.choice(groups) if groups else 1})
        if block is not None:
            blocks.append(block)
            widths.append(block.width)
    if not any(b.op == "norm" and b.args["kind"].startswith("layer_norm") for b in blocks):
        blocks.append(Block("norm", (len(widths) - 1,), widths[-1], {"kind": "layer_norm", "groups": 1}))
        widths.append(widths[-1])
    last = len(widths) - 1
    read = {i for b in blocks for i in b.inputs}
    # Most unread entries become outputs (real models rarely compute dead values); a few stay dead
    # code, and some read entries are returned too (a producer shared by a norm and an output).
    extra = {i for i in range(1, last) if (i not in read and rng.random() < 0.7) or rng.random() < 0.1}
    return Spec(seed, in_width, blocks, tuple(sorted(extra)) + (last,), ties)


def _aliases_input(blocks: list[Block], index: int) -> bool:
    """Env entry ``index`` is the model input x itself (eval dropout and in-place ops return their input)."""
    while index > 0 and blocks[index - 1].op in ("dropout", "in_place"):
        index = blocks[index - 1].inputs[0]
    return index == 0


def _choose(rng: random.Random, weighted: dict[str, int]) -> str:
    return rng.choices(list(weighted), weights=list(weighted.values()))[0]


# --------------------------------------------------------------------------- the module

class FuzzModel(nn.Module):
    """Interprets a Spec: ``forward(ids, x)`` with ids (B, T) int64 and x (B, T, in_width)."""

    def __init__(self, spec: Spec):
        super().__init__()
        self.spec = spec
        gen = torch.Generator().manual_seed(spec.seed)
        widths = [spec.in_width]
        self.recipes: dict[str, tuple[int, int | None]] = {}  # parameter FQN -> (output dim, group)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)  # the default init of Linear / Conv / Embedding
            for index, b in enumerate(spec.blocks):
                name = f"b{index}"
                module = self._make(name, b, widths[b.inputs[0]], gen)
                if module is not None:
                    self.add_module(name, module)
                widths.append(b.width)
        for name, source in spec.ties:
            getattr(self, name).weight = getattr(self, source).weight
            self.recipes[f"{name}.weight"] = (0, None)  # a Linear's view of the tied Embedding table

    def _make(self, name: str, b: Block, c: int, gen: torch.Generator) -> nn.Module | None:
        def randn(*shape, scale=1.0):
            return nn.Parameter(torch.randn(*shape, generator=gen) * scale)

        recipe = self.recipes
        if b.op == "linear":
            m = nn.Linear(c, b.width, bias=b.args["bias"])
            recipe[f"{name}.weight"] = (0, None)
            if m.bias is not None:
                m.bias = randn(b.width, scale=0.5)
                recipe[f"{name}.bias"] = (0, None)
            return m
        if b.op == "matmul_param":
            m = nn.Module()
            m.weight = randn(c, b.width, scale=c ** -0.5)  # x @ W: W (in, out)
            recipe[f"{name}.weight"] = (1, None)
            return m
        if b.op in ("conv1d", "conv2d"):
            conv = nn.Conv1d if b.op == "conv1d" else nn.Conv2d
            m = conv(c, b.width, b.args["kernel"], padding=b.args["kernel"] // 2, groups=b.args["groups"],
                     bias=b.args["bias"])
            per_group = b.width // b.args["groups"] if b.args["groups"] > 1 else None
            recipe[f"{name}.weight"] = (0, per_group)
            if m.bias is not None:
                m.bias = randn(b.width, scale=0.5)
                recipe[f"{name}.bias"] = (0, per_group)
            return m
        if b.op == "add_param":
            m = nn.Module()
            m.weight = randn(*((TIME, c) if b.args["per_time"] else (c,)), scale=0.5)
            recipe[f"{name}.weight"] = (m.weight.dim() - 1, None)
            return m
        if b.op == "in_place" and b.args["kind"] == "add_param":
            m = nn.Module()
            m.weight = randn(c, scale=0.5)
            recipe[f"{name}.weight"] = (0, None)
            return m
        if b.op == "mul_param":
            m = nn.Module()
            m.weight = randn(c, scale=0.5)
            return m
        if b.op == "add_embed":
            m = nn.Embedding(VOCAB, c)
            recipe[f"{name}.weight"] = (1, None)
            return m
        if b.op == "dropout":
            return nn.Dropout(0.1)
        if b.op == "heads" and b.args["inner"] in ("head_ln", "head_ln_plain"):
            d = c // b.args["heads"]
            m = nn.LayerNorm(d, elementwise_affine=b.args["inner"] == "head_ln")
            _randomize_affine(m, gen)
            return m
        if b.op == "norm":
            return _make_norm(b.args["kind"], c, b.args["groups"], gen)
        return None

    def forward(self, ids: Tensor, x: Tensor):
        env = [x]  # each entry (B, T, C)
        for index, b in enumerate(self.spec.blocks):
            module = getattr(self, f"b{index}", None)
            env.append(_apply(b, module, [env[i] for i in b.inputs], ids))
        return tuple(env[i] for i in self.spec.outputs)


def _randomize_affine(m: nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        if getattr(m, "weight", None) is not None:
            m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=gen))
        if getattr(m, "bias", None) is not None:
            m.bias.copy_(0.3 * torch.randn(m.bias.shape, generator=gen))


def _make_norm(kind: str, c: int, groups: int, gen: torch.Generator) -> nn.Module:
    if kind == "layer_norm":
        m = nn.LayerNorm(c)
    elif kind == "layer_norm_no_bias":
        m = nn.LayerNorm(c, bias=False)
    elif kind == "layer_norm_plain":
        m = nn.LayerNorm(c, elementwise_affine=False)
    elif kind == "rms_norm_torch":
        m = nn.RMSNorm(c, eps=1e-6)
    elif kind == "rms_norm_normfold":
        from normfold.nn import RMSNorm

        m = RMSNorm(c)
    elif kind == "group_norm":
        m = nn.GroupNorm(groups, c)
    elif kind == "batch_norm":
        m = nn.BatchNorm1d(c)
        with torch.no_grad():
            m.running_mean.copy_(torch.randn(c, generator=gen))
            m.running_var.copy_(0.5 + torch.rand(c, generator=gen))
    else:
        raise ValueError(f"unknown norm kind {kind!r}")
    _randomize_affine(m, gen)
    return m


def _apply(b: Block, module: nn.Module | None, xs: list[Tensor], ids: Tensor) -> Tensor:
    x = xs[0]  # (B, T, C)
    op = b.op
    if op == "add":
        return x + xs[1]
    if op == "sub":
        return x - xs[1]
    if op == "mul":
        return x * xs[1]
    if op == "cat":
        return torch.cat([x, xs[1]], dim=-1)
    if op == "linear":
        return module(x)
    if op == "matmul_param":
        return x @ module.weight
    if op == "conv1d":
        return module(x.transpose(1, 2)).transpose(1, 2)  # (B, C, T) for the conv
    if op == "conv2d":
        image = x.transpose(1, 2).reshape(x.shape[0], x.shape[2], 2, TIME // 2)  # (B, C, 2, T/2)
        return module(image).flatten(2).transpose(1, 2)
    if op == "add_param":
        return x + module.weight
    if op == "mul_param":
        return x * module.weight
    if op == "add_embed":
        return x + module(ids)
    if op == "scale":
        return x / b.args["value"] if b.args["divide"] else x * b.args["value"]
    if op == "act":
        return getattr(torch.nn.functional, b.args["fn"])(x)
    if op == "dropout":
        return module(x)
    if op == "in_place":  # mutates the env entry it reads: later readers of that entry see the new values
        kind = b.args["kind"]
        return x.add_(module.weight) if kind == "add_param" else x.mul_(0.5) if kind == "scale" else x.relu_()
    if op == "interleave":  # feature k·2 + j  <-  feature j·C/2 + k
        bsz, t, c = x.shape
        return x.view(bsz, t, 2, c // 2).transpose(-1, -2).reshape(bsz, t, c)
    if op == "heads":
        return _heads(b, module, x)
    if op == "norm":
        if isinstance(module, (nn.GroupNorm, nn.BatchNorm1d)):
            return module(x.transpose(1, 2)).transpose(1, 2)  # channels second
        return module(x)
    raise ValueError(f"unknown op {op!r}")


def _heads(b: Block, module: nn.Module | None, x: Tensor) -> Tensor:
    bsz, t, c = x.shape
    h = b.args["heads"]
    q = x.view(bsz, t, h, c // h).permute(0, 2, 1, 3)  # (B, H, T, D)
    inner = b.args["inner"]
    if inner == "scale":
        q = q * 0.25
    elif inner in ("head_ln", "head_ln_plain"):
        q = module(q)
    else:  # attention with q = k = v: softmax(q·kᵀ/√D)·v keeps each row a mix of v's rows
        attn = torch.softmax(q @ q.transpose(-1, -2) / math.sqrt(c // h), dim=-1)  # (B, H, T, T)
        q = attn @ q
    return q.permute(0, 2, 1, 3).reshape(bsz, t, c)


def make_inputs(spec: Spec, seed: int, dtype=torch.float64) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, TIME), generator=gen)                      # (B, T)
    x = torch.randn(BATCH, TIME, spec.in_width, generator=gen, dtype=torch.float64)  # (B, T, C)
    return ids, x.to(dtype)


# --------------------------------------------------------------------------- independent checks

@dataclass
class SeedResult:
    seed: int
    status: str                     # "ok" | "wrong" | "crash"
    norms: list[NormVerdict] = field(default_factory=list)
    max_rel_error: float = 0.0
    detail: str = ""
    spec: Spec | None = None

    def count(self, verdict: str) -> int:
        return sum(n.verdict == verdict for n in self.norms)


def check_seed(seed: int) -> SeedResult:
    """Generate, fold and judge one model (see the module docstring)."""
    return check_spec(generate(seed))


def check_spec(spec: Spec) -> SeedResult:
    """Build, fold and judge the model of one spec."""
    import normfold

    seed = spec.seed
    model = FuzzModel(spec).double().eval()
    example = make_inputs(spec, seed)
    result = SeedResult(seed, "ok", spec=spec)
    try:
        # every fourth model keeps γ/β on the norms: both transform paths get fuzzed
        folded, report = normfold.fold(model, example, fold_affine=seed % 4 != 0, verify=False)
        engine_verdict = normfold.verify(model, folded, example)
    except Exception as exc:  # any exception here is an engine (or generator) bug to report
        result.status = "crash"
        result.detail = f"{type(exc).__name__}: {exc}".splitlines()[0] + "\n" + traceback.format_exc(limit=4)
        return result
    folded = folded.eval()
    inputs = [make_inputs(spec, seed * 7919 + k + 1) for k in range(NUM_CHECK_INPUTS)]
    with torch.no_grad():
        reference = [model(*i) for i in inputs]
        outputs = [folded(*i) for i in inputs]
    result.max_rel_error = _max_rel_error(reference, outputs)
    outputs_equal = result.max_rel_error <= REL_TOL
    if engine_verdict.ok != outputs_equal:
        result.status = "wrong"
        result.detail = (f"normfold.verify says ok={engine_verdict.ok} (max rel {engine_verdict.max_rel_error:.2e}) "
                         f"but the independent check measured {result.max_rel_error:.2e}")
    layer_norms = [entry for entry in report.norms if entry.kind == "LayerNorm"]
    unfolded = dict.fromkeys((entry.path for entry in layer_norms if not entry.foldable), -1)
    refused = {v.path: v for v in judge_norms(model, model.recipes, unfolded, inputs, reference)} if unfolded else {}
    for entry in layer_norms:
        verdict = (_judge_claim(folded, entry.path, inputs, outputs_equal, result.max_rel_error) if entry.foldable
                   else refused[entry.path])
        verdict.engine_reason = entry.reason
        result.norms.append(verdict)
    if not outputs_equal and not any(n.verdict == "wrong" for n in result.norms):
        result.status = "wrong"  # an affine-only fold changed the model
        result.detail = result.detail or f"outputs changed (max rel {result.max_rel_error:.2e}) with no norm claimed foldable"
    wrong = [f"{n.path}: {n.detail}" for n in result.norms if n.verdict == "wrong"]
    if wrong:
        result.status = "wrong"
        result.detail = result.detail or "; ".join(wrong)
    return result


def _judge_claim(folded: nn.Module, path: str, inputs, outputs_equal: bool, rel: float) -> NormVerdict:
    from normfold.nn import RMSNorm

    module = folded.get_submodule(path)
    if not isinstance(module, RMSNorm):
        return NormVerdict(path, True, "wrong", f"claimed foldable but the folded model has {type(module).__name__} there")
    recorder = Recorder(module)
    try:
        with torch.no_grad():
            for i in inputs:
                folded(*i)
        ratio = worst_mean_ratio([x.double() for x in recorder.values])  # every call of the module, every input
    finally:
        recorder.handle.remove()
    if not outputs_equal:
        return NormVerdict(path, True, "wrong", f"outputs changed: max rel error {rel:.2e}")
    if ratio > MEAN_TOL:
        return NormVerdict(path, True, "wrong", f"new RMSNorm input not zero-mean: |mean|/rms {ratio:.2e}")
    return NormVerdict(path, True, "folded")


def _brute_force(model: FuzzModel, path: str, inputs, reference) -> NormVerdict:
    """The oracle (``centering_oracle.brute_force``) over the generator's centering recipes."""
    return brute_force(model, model.recipes, path, inputs, reference)


# --------------------------------------------------------------------------- shrinking

def shrink(spec: Spec, max_checks: int = 200) -> Spec:
    """A smaller spec that fails the same way (same status), by dropping outputs and blocks."""
    status = check_spec(spec).status
    checks = 0
    improved = True
    while improved and checks < max_checks:
        improved = False
        for candidate in _smaller(spec):
            checks += 1
            if check_spec(candidate).status == status:
                spec, improved = candidate, True
                break
            if checks >= max_checks:
                break
    return spec


def _smaller(spec: Spec):
    """Specs with one output fewer, or one width-preserving block removed (its readers read its input)."""
    live = _live_blocks(spec)
    if len(live) < len(spec.blocks):  # drop dead code in one step
        env = {0: 0, **{k + 1: n + 1 for n, k in enumerate(live)}}
        names = {f"b{k}": f"b{n}" for n, k in enumerate(live)}
        blocks = [Block(b.op, tuple(env[i] for i in b.inputs), b.width, b.args) for b in (spec.blocks[k] for k in live)]
        ties = [(names[a], names[b]) for a, b in spec.ties if a in names and b in names]
        yield Spec(spec.seed, spec.in_width, blocks, tuple(env[o] for o in spec.outputs), ties)
    for o in spec.outputs[:-1]:
        yield Spec(spec.seed, spec.in_width, spec.blocks, tuple(x for x in spec.outputs if x != o), spec.ties)
    widths = [spec.in_width] + [b.width for b in spec.blocks]
    for k, removed in enumerate(spec.blocks):
        if removed.width != widths[removed.inputs[0]]:
            continue
        gone = k + 1  # env index of the removed block

        def remap(i: int) -> int:
            return removed.inputs[0] if i == gone else i - (i > gone)

        def rename(name: str) -> str:
            j = int(name[1:])
            return f"b{j - (j > k)}"

        blocks = [Block(b.op, tuple(remap(i) for i in b.inputs), b.width, b.args)
                  for j, b in enumerate(spec.blocks) if j != k]
        ties = [(rename(a), rename(b)) for a, b in spec.ties if f"b{k}" not in (a, b)]
        outputs = tuple(dict.fromkeys(remap(o) for o in spec.outputs))
        if outputs[-1] == 0 or any(b.op == "in_place" and _aliases_input(blocks, b.inputs[0]) for b in blocks):
            continue
        yield Spec(spec.seed, spec.in_width, blocks, outputs, ties)


def _live_blocks(spec: Spec) -> list[int]:
    """Indices of the blocks an output depends on."""
    live, stack = set(), [o for o in spec.outputs if o > 0]
    while stack:
        k = stack.pop() - 1
        if k not in live:
            live.add(k)
            stack.extend(i for i in spec.blocks[k].inputs if i > 0)
    return sorted(live)


# --------------------------------------------------------------------------- fused, compiled, inference mode

def written_source(spec: Spec) -> str:
    """Source of a ``FuzzModel`` subclass whose forward writes each block out as one statement.

    ``FuzzModel.forward`` interprets the spec in a loop, where fusion finds no ``name = a + b``. This
    forward spells out the adds, norms, in-place ops and scalings (``e3 = e1 + e2``,
    ``e4 = self.b3(e3)``, ``e5 = e4.mul_(0.5)``), so ``fuse_residual_norms`` pairs adds with the norms
    they feed and its static check meets in-place changes; other ops call the interpreter's ``_apply``.
    """
    lines = [f"def forward(self, ids, e0):  # seed {spec.seed}"]
    for i, b in enumerate(spec.blocks):
        lines.append(f"    e{i + 1} = {_written_op(i, b)}")
    lines.append(f"    return ({''.join(f'e{k}, ' for k in spec.outputs)})")
    body = textwrap.indent("\n".join(lines), "    ")
    return f"from fold_fuzz import FuzzModel, _apply\n\n\nclass WrittenModel(FuzzModel):\n{body}\n"


def _written_op(i: int, b: Block) -> str:
    """One block as an expression, computing exactly what ``_apply`` computes for it."""
    x = f"e{b.inputs[0]}"
    if b.op == "add":
        return f"{x} + e{b.inputs[1]}"
    if b.op == "add_param":
        return f"{x} + self.b{i}.weight"
    if b.op == "add_embed":
        return f"{x} + self.b{i}(ids)"
    if b.op == "scale":
        return f"{x} {'/' if b.args['divide'] else '*'} {b.args['value']!r}"
    if b.op == "in_place":
        kind = b.args["kind"]
        return f"{x}.add_(self.b{i}.weight)" if kind == "add_param" else f"{x}.mul_(0.5)" if kind == "scale" \
            else f"{x}.relu_()"
    if b.op == "norm" and b.args["kind"] not in ("group_norm", "batch_norm"):
        return f"self.b{i}({x})"
    inputs = ", ".join(f"e{j}" for j in b.inputs)
    return f"_apply(self.spec.blocks[{i}], getattr(self, 'b{i}', None), [{inputs}], ids)"


def written_model(spec: Spec, folder: Path) -> FuzzModel:
    """``WrittenModel(spec)`` (float64, eval) from ``written_source`` saved in ``folder`` and imported from there."""
    name = f"fuzz_written_{spec.seed}_{len(spec.blocks)}_{abs(hash(repr(spec))) % 10**8}"
    path = folder / f"{name}.py"
    path.write_text(written_source(spec))
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.WrittenModel(spec).double().eval()


@dataclass
class FusedResult:
    seed: int
    status: str              # "ok" | "mismatch" | "crash" | "not folded" | "not compiled" | "compile differs"
    fused: int = 0           # add + norm pairs fused
    refused: int = 0         # norms an observed add fed, refused by the static in-place check
    max_rel_error: float = 0.0
    detail: str = ""


def check_compiled_fused(seed: int, folder: Path) -> FusedResult:
    """``check_compiled_fused_spec`` of the seed's generated model with residual adds before its norms."""
    return check_compiled_fused_spec(with_residual_adds(generate(seed)), folder)


def with_residual_adds(spec: Spec) -> Spec:
    """The spec with most norms fed by a residual add, some of them after an in-place op on the sum.

    ``generate`` rarely puts an add right before a norm; fusion needs that, and its static check
    needs in-place changes of the sum (``e5 = e4.mul_(0.5)``) between the add and the norm.
    """
    rng = random.Random(spec.seed * 7 + 1)
    widths, blocks = [spec.in_width], []
    entry = {0: 0}        # env index in spec -> env index in the new spec
    renamed = {}          # block index in spec -> block index in the new spec

    def append(block: Block) -> int:
        blocks.append(block)
        widths.append(block.width)
        return len(widths) - 1

    for index, b in enumerate(spec.blocks):
        inputs = tuple(entry[i] for i in b.inputs)
        if b.op == "norm" and b.args["kind"] not in ("group_norm", "batch_norm"):
            width = widths[inputs[0]]
            partners = [k for k, w in enumerate(widths) if w == width and k != inputs[0]]
            if partners and rng.random() < 0.8:
                total = append(Block("add", (inputs[0], rng.choice(partners[-3:])), width))
                if rng.random() < 0.35:
                    kind = rng.choice(("add_param", "scale", "relu"))
                    total = append(Block("in_place", (total,), width, {"kind": kind}))
                inputs = (total,)
        entry[index + 1] = append(Block(b.op, inputs, b.width, dict(b.args)))
        renamed[index] = len(blocks) - 1
    ties = [(f"b{renamed[int(a[1:])]}", f"b{renamed[int(source[1:])]}") for a, source in spec.ties]
    return Spec(spec.seed, spec.in_width, blocks, tuple(entry[i] for i in spec.outputs), ties)


def check_compiled_fused_spec(spec: Spec, folder: Path) -> FusedResult:
    """Fold the written model, fuse it, compile it (aot_eager), run it in inference mode: same outputs as the
    unfused folded model (relative error ≤ 1e-9 in float64, where a stale norm is off by O(1))?"""
    import normfold
    from normfold.fuse import fuse_residual_norms

    seed = spec.seed
    model = written_model(spec, folder)
    example = make_inputs(spec, seed)
    with torch.no_grad():
        interpreted = FuzzModel(spec).double().eval()(*example)
        if _max_rel_error([interpreted], [model(*example)]) != 0.0:
            return FusedResult(seed, "crash", detail="the written forward differs from the interpreter")
    try:
        folded, _ = normfold.fold(model, example, fold_affine=seed % 4 != 0, verify=False)
    except Exception as exc:  # the plain fuzz judges the fold; this mode needs a folded model
        return FusedResult(seed, "not folded", detail=f"{type(exc).__name__}: {exc}".splitlines()[0])
    result = FusedResult(seed, "ok")
    inputs = [make_inputs(spec, seed * 7919 + k + 1) for k in range(NUM_CHECK_INPUTS)]
    try:
        fused, report = fuse_residual_norms(folded.eval(), example)  # includes the eager float64 verify
        result.fused = len(report.fused)
        result.refused = sum("changed in place" in why or "cannot be proved" in why for why in report.skipped.values())
        torch._dynamo.reset()
        compiled = torch.compile(fused, backend="aot_eager")
        with torch.inference_mode():
            outputs = [compiled(*i) for i in inputs]
            reference = [folded(*i) for i in inputs]
    except Exception as exc:
        result.status = "not compiled" if _compiled_outputs(folded, inputs[:1]) is None else "crash"
        result.detail = f"{type(exc).__name__}: {exc}".splitlines()[0] + "\n" + traceback.format_exc(limit=4)
        return result
    result.max_rel_error = _max_rel_error(reference, outputs)
    if result.max_rel_error > REL_TOL:
        unfused = _compiled_outputs(folded, inputs)
        same_as_unfused = unfused is not None and _max_rel_error(unfused, outputs) <= REL_TOL
        result.status = "compile differs" if same_as_unfused else "mismatch"
        result.detail = (f"compiled fused model differs from the folded one: max rel error {result.max_rel_error:.2e}"
                         + ("; the compiled unfused fold gives the same outputs" if same_as_unfused else ""))
    return result


def _compiled_outputs(model: nn.Module, inputs: list) -> list | None:
    """The outputs of ``torch.compile(model, backend="aot_eager")`` in inference mode, None when it fails.

    Run on the unfused fold to tell fusion's findings from torch.compile's own: some generated view
    chains do not compile, and eval dropout (which returns its input) followed by an in-place op
    compiles to other values than eager code gives.
    """
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="aot_eager")
        with torch.inference_mode():
            return [compiled(*i) for i in inputs]
    except Exception:  # noqa: BLE001 (any failure means: not a fusion finding)
        return None


def _max_rel_error(reference: list, outputs: list) -> float:
    return max(rel_error(r, o) for rs, os in zip(reference, outputs, strict=True) for r, o in zip(rs, os, strict=True))
