"""A compact GPT for norm experiments, in the spirit of nanoGPT.

Module names follow Hugging Face's GPT-2 (``transformer.wte``, ``transformer.h.0.ln_1``,
``attn.c_attn``, ``mlp.c_proj``, ``ln_f``, ``lm_head``) so that a Pre-LN LayerNorm model converts
to a ``GPT2LMHeadModel`` by transposing the linear weights (see ``normfold.train.checkpoint``).

The norm under test and where it sits are config choices:

* ``placement="pre"``      x = x + attn(ln_1(x));  x = x + mlp(ln_2(x));  logits = head(ln_f(x))
* ``placement="post"``     x = ln_1(x + attn(x));  x = ln_2(x + mlp(x));  logits = head(x)
* ``placement="sandwich"`` x = x + ln_1_post(attn(ln_1(x))), same for the MLP; final ln_f

Every residual add that a norm reads runs inside that norm when it is one of normfold's (:func:`add_norm`):
a block returns the stream as (x, branch), its last add left to the next norm, so ``Block.stream(output)``
is the stream after it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..nn import LayerNorm as FusedLayerNorm
from ..nn import RMSNorm

NORMS = ("layernorm", "layernorm_handrolled", "rmsnorm_torch", "rmsnorm_handrolled", "rmsnorm", "cbwc_rmsnorm", "none")
PLACEMENTS = ("pre", "post", "sandwich")


def check_positive_ints(config: object, names: tuple[str, ...]) -> None:
    """ValueError naming the first of ``config``'s fields ``names`` that is not a positive int (a bool is not)."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass
class GPTConfig:
    """Architecture of the experiment GPT. Defaults give a 1.3M-parameter model that trains on a CPU."""

    vocab_size: int = 256  # byte-level tokenizer: every byte is a token, no hub download
    block_size: int = 128  # context length; long enough for sentence structure, cheap on CPU
    n_layer: int = 4  # depth at which Pre- vs Post-LN start to differ, still fast
    n_head: int = 4  # head_dim = n_embd / n_head = 40, a GPT-2-like head size at this width
    n_embd: int = 160  # 1.23M parameters in the blocks (1.30M in all): inside the 1–5M budget of the CPU experiments
    dropout: float = 0.0  # 0 keeps LayerNorm and CBWC training identical; the seeds train without it
    bias: bool = True  # GPT-2 has biases everywhere; needed for Hugging Face GPT-2 checkpoints
    norm: str = "layernorm"  # one of NORMS; GPT-2's norm
    placement: str = "pre"  # one of PLACEMENTS; GPT-2 is Pre-LN
    qk_norm: bool = False  # normalize queries and keys per head (seed 004) with the same norm kind
    norm_eps: float = 1e-5  # torch.nn.LayerNorm's and GPT-2's default
    tie_embeddings: bool = True  # GPT-2 ties lm_head to wte; it also halves the embedding parameters

    def __post_init__(self) -> None:
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        check_positive_ints(self, ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"))
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd must be divisible by n_head, got n_embd={self.n_embd}, n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps!r}")


class HandrolledLayerNorm(nn.Module):
    """LayerNorm from elementary ops (seed 003's "hand-rolled" baseline): several kernels, not one."""

    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n))

    def forward(self, x: Tensor) -> Tensor:
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)  # biased variance, as nn.LayerNorm
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


class HandrolledRMSNorm(nn.Module):
    """RMSNorm from elementary ops: y = x / sqrt(mean(x²) + eps) · weight."""

    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(kind: str, n: int, eps: float) -> nn.Module:
    """The norm module for ``GPTConfig.norm``. ``cbwc_rmsnorm`` builds a LayerNorm that
    ``normfold.cbwc_`` later turns into a centered RMSNorm."""
    if kind in ("layernorm", "cbwc_rmsnorm"):
        return nn.LayerNorm(n, eps=eps)
    if kind == "layernorm_handrolled":
        return HandrolledLayerNorm(n, eps)
    if kind == "rmsnorm_torch":
        return nn.RMSNorm(n, eps=eps)
    if kind == "rmsnorm_handrolled":
        return HandrolledRMSNorm(n, eps)
    if kind == "rmsnorm":
        return RMSNorm(n, eps=eps)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")


def add_norm(norm: nn.Module, branch: Tensor | None, stream: Tensor) -> tuple[Tensor, Tensor]:
    """(s, norm(s)) with s = stream + branch (s = stream when branch is None): a residual add and the norm that
    reads it. In training, normfold's norms take the add into their kernel (one pass over the stream instead of
    two; the backward adds the residual's gradient in the same pass); every other norm, and every norm in eval
    mode, adds first, so that what the fold and rotation engines trace (in eval mode) is plain adds and norms.
    The same function either way."""
    if branch is None:
        return stream, norm(stream)
    if norm.training and isinstance(norm, (RMSNorm, FusedLayerNorm)):
        # the kernels add in one element type: under autocast the branch is a matmul's bf16 output and the stream
        # float32, so the branch is cast first (the promotion ``stream + branch`` makes); mixed dtypes would leave
        # the kernel for the pure-PyTorch reference
        y, s = norm(branch.to(stream.dtype), residual=stream)
        return s, y
    s = stream + branch
    return s, norm(s)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        head_dim = config.n_embd // config.n_head
        self.q_norm = make_norm(config.norm, head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = make_norm(config.norm, head_dim, config.norm_eps) if config.qk_norm else None
        self.attn_dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 × (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head)  # (B, T, nh, hd)
        k = k.view(B, T, self.n_head, C // self.n_head)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hd)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        p = self.attn_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, nh, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        # GPT-2's "gelu_new" is the tanh approximation
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.placement = config.placement
        norm = lambda: make_norm(config.norm, config.n_embd, config.norm_eps)  # noqa: E731
        self.ln_1 = norm()
        self.attn = CausalSelfAttention(config)
        self.ln_2 = norm()
        self.mlp = MLP(config)
        if config.placement == "sandwich":
            self.ln_1_post = norm()
            self.ln_2_post = norm()

    def forward(self, x: Tensor, branch: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """The block on the residual stream x + branch; returns the stream after it in the same form.

        ``branch`` is the previous block's last sublayer output: its residual add is left to this block's first
        norm, so that every add a norm reads runs inside that norm (:func:`add_norm`), as in fused-add-norm
        transformers. (B, T, C) each; branch None: the stream is x.
        """
        if self.placement == "pre":
            x, h = add_norm(self.ln_1, branch, x)  # x + branch, and ln_1 of it
            x, h = add_norm(self.ln_2, self.attn(h), x)  # x + attn(ln_1(x)), and ln_2 of it
            return x, self.mlp(h)
        if self.placement == "post":
            x = self.stream((x, branch))  # a Post-LN block hands on no branch: its stream ends in a norm
            _, x = add_norm(self.ln_1, self.attn(x), x)  # ln_1(x + attn(x))
            _, x = add_norm(self.ln_2, self.mlp(x), x)
            return x, None
        x, h = add_norm(self.ln_1, branch, x)
        x, h = add_norm(self.ln_2, self.ln_1_post(self.attn(h)), x)
        return x, self.ln_2_post(self.mlp(h))

    @staticmethod
    def stream(output: tuple[Tensor, Tensor | None]) -> Tensor:
        """The residual stream after a block from its output (x, branch): x + branch."""
        x, branch = output
        return x if branch is None else x + branch


def set_dropout(model: nn.Module, rate: float) -> None:
    """Set every dropout rate of an experiment GPT (its ``nn.Dropout`` modules and attention's) and its config.

    For a model built without dropout and changed afterwards, e.g. CBWC proved on the dropout-free model
    (the fold engine will not center through dropout) and then trained with dropout, as in seed 002.
    """
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a normfold.train.GPT, got {type(model).__name__}")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {rate!r}")
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = rate
        elif isinstance(module, CausalSelfAttention):
            module.attn_dropout = rate
    model.config.dropout = rate


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            # Post-LN blocks already end in a norm; the other placements need a final one
            ln_f=nn.Identity() if config.placement == "post" else make_norm(config.norm, config.n_embd, config.norm_eps),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2·n_layer) so the stream's variance stays O(1)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_input_embeddings(self) -> nn.Embedding:
        """The token table (Hugging Face's name: ``normfold.engine.transform.untie_config`` reads it)."""
        return self.transformer.wte

    def get_output_embeddings(self) -> nn.Linear:
        """The output head, tied to the token table when ``config.tie_embeddings``."""
        return self.lm_head

    def num_parameters(self) -> int:
        """Distinct parameters (a tied table counted once)."""
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits (B, T, vocab) and, given targets (B, T), the mean cross-entropy."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length must be <= block_size={self.config.block_size}, got {T}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        branch = None  # the stream is x + branch: each block's last residual add is left to the next norm
        for block in self.transformer.h:
            x, branch = block(x, branch)
        _, y = add_norm(self.transformer.ln_f, branch, x)
        logits = self.lm_head(y)  # (B, T, vocab)
        if targets is None:
            return logits, None
        # loss in at least fp32 (logits may be bf16 under autocast; fp64 stays fp64)
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = F.cross_entropy(wide.view(-1, wide.size(-1)), targets.view(-1))
        return logits, loss
