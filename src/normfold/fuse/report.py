"""What ``fuse_residual_norms`` did: the pairs it fused and, for every other candidate norm, why not."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class FusedPair:
    """One add in ``parent``'s forward fused into the call of its child norm ``norm``."""

    parent: str      # module path of the module whose forward was rewritten
    norm: str        # module path of the norm (RMSNorm or LayerNorm)
    add: str         # the source of the add ("hidden_states = attn_output + residual", "self.ln(h + x)")


@dataclass
class FuseReport:
    """What ``fuse_residual_norms`` fused, and for every other candidate norm why not."""

    fused: list[FusedPair] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)   # norm path -> reason
    verification: object | None = None                     # VerifyResult of the float64 check

    def to_dict(self) -> dict:
        ver = self.verification.to_dict() if self.verification is not None else None
        return {"fused": [asdict(p) for p in self.fused], "skipped": dict(self.skipped), "verification": ver}

    def __str__(self) -> str:
        lines = [f"fused {len(self.fused)} residual add(s) into norms, {len(self.skipped)} norm(s) left alone"]
        lines += [f"  fused   {p.norm}  <-  {p.add}" for p in self.fused]
        lines += [f"  skipped {path}: {why}" for path, why in self.skipped.items()]
        return "\n".join(lines)
