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
    pairs_from: str = ""   # "graph": add -> norm pairs read from a torch.export graph; "probe": from an eager run
    pairs_why: str = ""    # which graph, or why there was none

    def to_dict(self) -> dict:
        ver = self.verification.to_dict() if self.verification is not None else None
        return {"fused": [asdict(p) for p in self.fused], "skipped": dict(self.skipped), "verification": ver,
                "pairs_from": self.pairs_from, "pairs_why": self.pairs_why}

    def __str__(self) -> str:
        lines = [f"fused {len(self.fused)} residual add(s) into norms, {len(self.skipped)} norm(s) left alone"
                 + (f" (pairs from the {self.pairs_from}: {self.pairs_why})" if self.pairs_from else "")]
        lines += [f"  fused   {p.norm}  <-  {p.add}" for p in self.fused]
        lines += [f"  skipped {path}: {why}" for path, why in self.skipped.items()]
        return "\n".join(lines)
