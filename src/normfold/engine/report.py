"""What the fold engine found, per norm, in a form to print or to serialize."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Protocol

from .batchnorm import BatchNormEntry
from .plan import FoldConfig, FoldPlan

RANDOM_DRAWS_NOTE = ("; the original's forward draws random numbers (eval mode too): every run of both models "
                     "started from the same seed, so both compared on the same draws")


class ReportSection(Protocol):
    """What a step after the fold files in the report (``FoldReport.sections``): plain data to
    serialize, and a text to print (its ``__str__``); its class is the one the step registered."""

    def to_dict(self) -> dict: ...


@dataclass
class NormEntry:
    """One norm module (or functional norm call) of the model."""

    path: str                      # module path ("transformer.h.0.ln_1")
    kind: str                      # "LayerNorm" or "RMSNorm" (as found in the model)
    foldable: bool                 # its input is zero-mean by construction after centering `producers`
    affine_folded: bool            # its γ/β move into the linear layers that read it
    reason: str                    # one sentence: why it folds, or what blocks it
    producers: tuple[str, ...] = ()      # parameter FQNs centered for it
    blocking_path: tuple[str, ...] = ()  # from the norm's input back to the op that blocks it
    blocker: str | None = None           # a blocked norm: what breaks zero mean at blocking_path[-1] (in `reason` too)
    affine_kept: str | None = None       # why its γ/β stayed in the norm (the end of `reason`), None when they moved


@dataclass
class WorstElement:
    """Where a comparison's judged error is largest: the output, the element, both values."""

    output: str                    # the output's name ("out['logits']")
    index: list[int]               # the element's index in that output
    original: float
    folded: float
    error: float                   # its judged error (inf: the two values are of different kinds)
    input: int = 0                 # which of the compared inputs

    def __str__(self) -> str:
        return (f"{self.output}[{', '.join(map(str, self.index))}] on input {self.input}: original "
                f"{self.original:.6g}, folded {self.folded:.6g}")


@dataclass
class ModelDtypeCheck:
    """The model a step returns, run in its own dtype, against the original in float64 (in that dtype on the
    same draws, for a forward that draws random numbers): its error must be within the tolerance measured
    from the original's own error in that dtype, and it may not give inf/nan where the original in that dtype
    is finite (``fold``, ``fuse_residual_norms``, ``rotate``, ``convert``)."""

    dtype: str
    error: float                   # the returned model's error (the metric of normfold.engine.verify.output_error)
    own_error: float               # the original's own error in `dtype` against its float64 self
    tolerance: float
    tolerance_rule: str
    worst: WorstElement | None = None

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance

    def __str__(self) -> str:
        at = "" if self.worst is None else f", worst at {self.worst}"
        return (f"the returned model in {self.dtype}: error {self.error:.1e} "
                f"{'≤' if self.ok else '>'} tolerance {self.tolerance:.1e} = {self.tolerance_rule}{at}")


# A failed comparison's worst output "jumps" when the original's own moves past this multiple of its weights'
# relative move (normfold.engine.verify.original_jump): a continuous output of a well-conditioned model moves by
# about the weights' move; a top-k over scores that tie within that move reorders its rows, an O(1) change.
JUMP_MULTIPLE = 1e3


@dataclass
class VerifyResult:
    """Output differences between an original and a folded model.

    The errors are those of :func:`normfold.engine.verify.output_error`: per output, the largest
    |a − b| / (typical |a| + |a|) over its ordinary elements (typical: the output's median magnitude),
    inf where the two hold different kinds of value (inf, nan, a finfo extreme such as a mask's
    ``finfo.min``, or an ordinary number) at the same place.
    """

    outputs: list[dict]            # per output: name, dtype, max_abs, max_rel, argmax_agreement, index
    max_rel_error: float           # the judged run: max over outputs of the error above
    max_abs_error: float
    model_dtype_max_rel_error: float | None  # the returned model in its dtype vs the original in float64 (None: float64)
    max_input_mean_ratio: float | None       # max |mean|/rms of the new RMSNorms' inputs (float64)
    tolerance: float = 1e-9
    num_runs: int = 0
    tolerance_rule: str = "fixed"  # how `tolerance` was set ("fixed", or the measured rule with its numbers)
    stored_dtype_own_error: float | None = None  # measured rule: the original's own error in the stored dtype
    why: str | None = None         # set when the outputs could not be compared (then never ok)
    compared_in: str = "float64"   # the dtype the judged comparison ran in
    fallback: str | None = None    # why it is not float64 (the model cannot run in float64), else None
    worst: WorstElement | None = None              # where the judged comparison's error is largest
    model_dtype_check: ModelDtypeCheck | None = None  # set when the returned model is judged in its own dtype
    integers_kept: str | None = None  # which fresh inputs kept the example's integers (the original rejected them permuted)
    random_draws: bool = False  # the original's forward draws random numbers: every run compared under one seed
    # a failed comparison: how far the original's own output at the worst place moves when every weight moves by
    # the tolerance of itself (normfold.engine.verify.original_jump); past JUMP_MULTIPLE x that, it jumps there
    original_jump: float | None = None

    @property
    def ok(self) -> bool:
        return (self.why is None and self.max_rel_error <= self.tolerance
                and (self.model_dtype_check is None or self.model_dtype_check.ok))

    def failure(self) -> str:
        """One line saying why the result is not ok: the reason the outputs could not be compared
        first, else each failed check with its numbers and worst element."""
        if self.why is not None:
            return self.why + (RANDOM_DRAWS_NOTE if self.random_draws else "")
        failed = []
        if not self.max_rel_error <= self.tolerance:
            at = "" if self.worst is None else f" at {self.worst}"
            failed.append(f"{self.compared_in} max relative error {self.max_rel_error:.3e} > {self.tolerance:.1e}{at}")
            if self.original_jump is not None and self.original_jump > JUMP_MULTIPLE * self.tolerance:
                failed[-1] += (f" (the original's own output there moves by {self.original_jump:.3e} when every "
                               f"weight moves by {self.tolerance:.0e} of itself: it jumps at this input, a top-k, sort "
                               "or argmax over nearly tied values, so it proves nothing of a transform)")
        if self.model_dtype_check is not None and not self.model_dtype_check.ok:
            failed.append(str(self.model_dtype_check))
        return "; ".join(failed) + (RANDOM_DRAWS_NOTE if self.random_draws else "") if failed else "passed"

    def to_dict(self) -> dict:
        data = {**asdict(self), "ok": self.ok}
        if self.model_dtype_check is not None:
            data["model_dtype_check"]["ok"] = self.model_dtype_check.ok
        return data

    def __str__(self) -> str:
        fallback = "" if self.fallback is None else f" ({self.fallback})"
        if self.why is not None:
            return f"verify: FAILED over {self.num_runs} inputs{fallback}: {self.why}"
        mean = "n/a" if self.max_input_mean_ratio is None else f"{self.max_input_mean_ratio:.1e}"
        own = "n/a" if self.model_dtype_max_rel_error is None else f"{self.model_dtype_max_rel_error:.1e}"
        rule = "" if self.tolerance_rule == "fixed" else f" = {self.tolerance_rule}"
        worst = "" if self.worst is None or self.max_rel_error <= self.tolerance else f", worst at {self.worst}"
        checked = "" if self.model_dtype_check is None else f"; {self.model_dtype_check}"
        kept = "" if self.integers_kept is None else f"; {self.integers_kept}"
        kept += RANDOM_DRAWS_NOTE if self.random_draws else ""
        return (f"verify: {'OK' if self.ok else 'FAILED'} over {self.num_runs} inputs{fallback}{kept}; "
                f"{self.compared_in} max rel err "
                f"{self.max_rel_error:.1e} (tolerance {self.tolerance:.1e}{rule}){worst}, max abs err "
                f"{self.max_abs_error:.1e}; model dtype max rel err {own}{checked}; "
                f"RMSNorm inputs max |mean|/rms {mean}")


@dataclass
class FoldReport:
    norms: list[NormEntry]
    plan: FoldPlan = field(default_factory=FoldPlan)
    untied: list[str] = field(default_factory=list)   # "lm_head.weight (copy of transformer.wte.weight)"
    verification: VerifyResult | None = None
    batchnorms: list[BatchNormEntry] = field(default_factory=list)  # one per BatchNorm module
    traced_calls: list[dict] = field(default_factory=list)  # per example call: argument name -> what it was
    constraints: FoldConfig | None = None  # what the plan was made within: the options, a loader's limits
    # the sections the steps after the fold filed (normfold.convert), by the name each registered
    # (normfold.engine.steps.register_step, which also holds each section's type): "fuse", "approximate", ...
    sections: dict[str, ReportSection] = field(default_factory=dict)
    # the submodules analysed when torch.export could not capture the whole model (normfold.engine.submodules),
    # and export's reason; empty and None when the whole model was captured
    captured_through: list[str] = field(default_factory=list)
    whole_model_capture_error: str | None = None

    @property
    def fuse(self):
        """The fusion step's section (``normfold.fuse.FuseReport``), None when fusion did not run."""
        return self.sections.get("fuse")

    @property
    def approximate(self):
        """The approximate fold's section (``normfold.lab.ApproximateReport``), None when it did not run."""
        return self.sections.get("approximate")

    @property
    def exactness_scope(self) -> str:
        """What the fold is exact for: the traced call(s), and other calls that take the same path."""
        n = len(self.traced_calls)
        which = "the traced call" if n == 1 else f"each of the {n} traced calls"
        return (f"exact for {which} and for calls that take the same path through the model (same arguments "
                "given, same branches); another call (e.g. inputs_embeds instead of input_ids, or "
                "output_hidden_states=True) may differ: pass every kind of call as a list of example inputs")

    @property
    def capture_line(self) -> str | None:
        """``captured through submodules: a, b (...)``, None when the whole model was captured."""
        if not self.captured_through:
            return None
        return (f"captured through submodules: {', '.join(self.captured_through)} (torch.export could not capture "
                f"the whole model: {self.whole_model_capture_error}; the proof runs the whole model)")

    @property
    def num_norms(self) -> int:
        return len(self.norms)

    @property
    def num_foldable(self) -> int:
        return sum(e.foldable for e in self.norms)

    @property
    def num_affine_folded(self) -> int:
        return sum(e.affine_folded for e in self.norms)

    @property
    def num_batchnorms_folded(self) -> int:
        return sum(e.folded for e in self.batchnorms)

    @property
    def num_approximate(self) -> int:
        """Norms replaced approximately (``fold(approximate=True)``); 0 for an exact fold."""
        return 0 if self.approximate is None else self.approximate.num_approximate

    def to_dict(self) -> dict:
        return {
            "num_norms": self.num_norms,
            "num_foldable": self.num_foldable,
            "num_affine_folded": self.num_affine_folded,
            "norms": [asdict(e) for e in self.norms],
            "untied": list(self.untied),
            "plan": self.plan.to_dict(),
            "verification": None if self.verification is None else self.verification.to_dict(),
            "batchnorms": [asdict(e) for e in self.batchnorms],
            "num_approximate": self.num_approximate,
            "approximate": None, "fuse": None,  # present (None) when the step did not run
            **{name: section.to_dict() for name, section in self.sections.items()},
            "traced_calls": [dict(call) for call in self.traced_calls],
            "exactness_scope": self.exactness_scope if self.traced_calls else None,
            "captured_through": list(self.captured_through),
            "whole_model_capture_error": self.whole_model_capture_error,
            "capture_line": self.capture_line,
        }

    def __str__(self) -> str:
        head = ("norm", "kind", "fold", "affine", "reason")
        rows = [(e.path, e.kind, "yes" if e.foldable else "no", "yes" if e.affine_folded else "no", e.reason)
                for e in self.norms]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
        lines = [f"{self.num_foldable}/{self.num_norms} norms foldable, {self.num_affine_folded} affine-folded"]
        for r in [head, *rows]:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
        if self.untied:
            lines.append("untied: " + ", ".join(self.untied))
        for i, call in enumerate(self.traced_calls):
            lines.append(f"traced call {i}: " + ", ".join(f"{k}={v}" for k, v in call.items()))
        if self.traced_calls:
            lines.append(self.exactness_scope)
        if self.capture_line:
            lines.append(self.capture_line)
        for e in self.batchnorms:
            lines.append(f"BatchNorm {e.path}: {'folded' if e.folded else 'kept'} ({e.reason})")
        if self.verification is not None:
            lines.append(str(self.verification))
        if self.approximate is not None:  # fusion leaves outputs unchanged: its section prints on its own
            lines.append(str(self.approximate))
        return "\n".join(lines)
