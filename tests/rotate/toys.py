"""Small models whose residual stream is read or written in one chosen way, for the closure tests."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, WIDTH, SEQ = 50, 16, 6


def _norm(kind: str, width: int = WIDTH) -> nn.Module:
    """"ln": LayerNorm with γ/β; "rms": weightless RMSNorm; "rms_gamma": RMSNorm with γ."""
    if kind == "ln":
        return nn.LayerNorm(width)
    return nn.RMSNorm(width, eps=1e-6, elementwise_affine=kind == "rms_gamma")


class Stream(nn.Module):
    """Embedding + position table, one pre-norm MLP block, a final norm and a head.

    ``tap``: how else the stream is read: None, "relu" (an activation of the stream is added to the
    logits), "output" (the stream is returned too), "norm_relu" (the final norm's output goes
    through a ReLU before the head), "select" (the head reads the first position only), "tied"
    (the head is the embedding table).
    """

    def __init__(self, norm: str = "ln", tap: str | None = None, final_norm: str | None = None):
        super().__init__()
        self.tap = tap
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH))
        self.norm1, self.norm2 = _norm(norm), _norm(final_norm or norm)
        self.fc1, self.fc2 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tap == "tied":
            self.head.weight = self.embed.weight
        with torch.no_grad():
            for m in (self.norm1, self.norm2):
                for p in m.parameters():
                    p.add_(0.3 * torch.randn_like(p))

    def forward(self, ids):
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        x = x + self.fc2(F.gelu(self.fc1(self.norm1(x))))
        h = self.norm2(x)
        if self.tap == "norm_relu":
            h = torch.relu(h)
        if self.tap == "select":
            h = h[:, 0]
        y = self.head(h)
        if self.tap == "relu":
            return y + torch.relu(x).mean(-1, keepdim=True)
        if self.tap == "output":
            return y, x
        return y


class Patches(nn.Module):
    """ViT-like: a patch conv, a cls token and a position table write the stream; the head reads the cls row."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, WIDTH, kernel_size=4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, 1, WIDTH))
        self.pos = nn.Parameter(torch.randn(1, 5, WIDTH))
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH, elementwise_affine=False)
        self.fc, self.out = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, pixels):
        x = self.patch(pixels).flatten(2).transpose(1, 2)               # (B, 4, C)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        x = x + self.out(torch.tanh(self.fc(self.norm1(x))))
        return self.head(self.norm2(x)[:, 0])


class TwoTowers(nn.Module):
    """Two separate streams of different widths whose heads' outputs are added."""

    def __init__(self):
        super().__init__()
        self.a, self.b = Stream("ln"), Stream("ln")
        self.b.embed, self.b.pos = nn.Embedding(VOCAB, 12), nn.Parameter(torch.randn(SEQ, 12))
        self.b.norm1, self.b.norm2 = nn.LayerNorm(12), nn.LayerNorm(12)
        self.b.fc1, self.b.fc2, self.b.head = nn.Linear(12, 24), nn.Linear(24, 12), nn.Linear(12, VOCAB)

    def forward(self, ids):
        return self.a(ids) + self.b(ids)


def token_ids(batch: int = 2, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


class Blocks(nn.Module):
    """A pre-norm stack drawn from a few choices: ``width``, ``depth``, the norm kind, blocks whose
    attention-like and MLP branches share one norm (``parallel``, Falcon / GPT-J style) or not, and
    whether the head reads every position or the first one."""

    def __init__(self, width: int, depth: int, norm: str, parallel: bool, first_token: bool):
        super().__init__()
        self.parallel, self.first_token = parallel, first_token
        self.embed, self.pos = nn.Embedding(VOCAB, width), nn.Parameter(torch.randn(SEQ, width))
        self.norms = nn.ModuleList(_norm(norm, width) for _ in range(depth * (1 if parallel else 2) + 1))
        self.mix = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))        # token-mixing branch
        self.mix_out = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(depth))
        self.up = nn.ModuleList(nn.Linear(width, 2 * width) for _ in range(depth))
        self.down = nn.ModuleList(nn.Linear(2 * width, width) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB)
        with torch.no_grad():
            for p in self.norms.parameters():
                p.add_(0.3 * torch.randn_like(p))

    def forward(self, ids):
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        norms = iter(self.norms)
        for mix, mix_out, up, down in zip(self.mix, self.mix_out, self.up, self.down):
            h = next(norms)(x)
            a = mix(h)
            mixed = mix_out(torch.softmax(a @ a.transpose(-1, -2), -1) @ a)
            if self.parallel:
                x = x + mixed + down(F.gelu(up(h)))
            else:
                x = x + mixed
                x = x + down(F.gelu(up(next(norms)(x))))
        h = next(norms)(x)
        return self.head(h[:, 0] if self.first_token else h)
