"""The folder report (``normfold_report.json``) as typed, frozen data: one dataclass per section,
:meth:`FolderReport.to_json` / :meth:`FolderReport.from_json`, and the schema version checked in one
place (:func:`check_schema`).

Nothing normfold wrote has been released, so there is one layout: a report of another schema version,
or one that lacks a section or holds a value of another type, is refused with a ``CheckpointError``
naming the key; it is never read by guessing. Sections that steps above hf own (the approximate
fold's, fusion's, the rotation's: ``FolderReport.sections``) and the verification figures, whose keys
differ by how the fold was proved (in memory, block by block), are kept as the JSON objects those
steps wrote: hf never imports their types (``docs/CONTRIBUTING.md``).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .errors import CheckpointError
from .recipe import Recipe

# The version of normfold_report.json's layout. Readers accept this one only: a report of another schema
# is refused with both numbers (fold again), never read by guessing. Raise it when a key changes meaning.
REPORT_SCHEMA = 1


def check_schema(data: Mapping[str, Any], where: object) -> None:
    """CheckpointError unless ``data`` (a report read from ``where``) has this normfold's
    :data:`REPORT_SCHEMA`: the one place the version is checked."""
    schema = data.get("schema_version")
    if type(schema) is not int or schema != REPORT_SCHEMA:
        raise CheckpointError(f"{where} has report schema {schema!r}; this normfold reads schema {REPORT_SCHEMA}: "
                              "fold the original again with this normfold")


# ------------------------------------------------------------------------------------ reading values

_ABSENT = object()
_KINDS = {str: "a string", bool: "true or false", int: "an integer", float: "a number", list: "a list",
          dict: "an object"}


def _not_a_report(where: object, what: str) -> CheckpointError:
    return CheckpointError(f"{where} is not a normfold report: {what}")


def _is(value: object, kind: type) -> bool:
    """JSON's types: a bool is no number, an int is a number (a list may be a tuple in data not yet written)."""
    if kind is list:
        return isinstance(value, (list, tuple))
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _take(data: Mapping[str, Any], key: str, kind: type, where: object, at: str = "", *,
          nullable: bool = False, default: Any = _ABSENT) -> Any:
    """``data[key]``, checked to be of ``kind`` (None too when ``nullable``); ``default`` when the key is
    absent, CheckpointError naming ``at`` + ``key`` when it is absent without one or of another type."""
    if key not in data:
        if default is _ABSENT:
            raise _not_a_report(where, f"it lacks \"{at}{key}\"")
        return default
    value = data[key]
    if value is None and nullable:
        return None
    if not _is(value, kind):
        raise _not_a_report(where, f"\"{at}{key}\" must be {_KINDS[kind]}{' or null' if nullable else ''}, got "
                                   f"{type(value).__name__}")
    return value


def _strings(data: Mapping[str, Any], key: str, where: object, at: str = "", **options: Any) -> tuple[str, ...]:
    values = _take(data, key, list, where, at, **options)
    if values is None or not all(isinstance(v, str) for v in values):
        raise _not_a_report(where, f"\"{at}{key}\" must list strings")
    return tuple(values)


def _objects(data: Mapping[str, Any], key: str, where: object, at: str = "", **options: Any) -> list[dict] | None:
    values = _take(data, key, list, where, at, **options)
    if values is None:  # absent, with a default of None
        return None
    bad = next((i for i, v in enumerate(values) if not isinstance(v, dict)), None)
    if bad is not None:
        raise _not_a_report(where, f"{at}{key}[{bad}] must be an object")
    return values


def _sizes(value: object) -> bool:
    return isinstance(value, list) and all(_is(n, int) and n >= 0 for n in value)


# ------------------------------------------------------------------------------------------- the layout

@dataclass(frozen=True)
class SwappedNorm:
    """A normfold RMSNorm where a stock model of the class has a LayerNorm, with the γ/β it kept, the
    ``offset`` of (offset + γ) (Nemotron's LayerNorm1P), the ``permute`` around a channels-first norm
    (ConvNeXt's), and, after an approximate fold, whether it is an approximate replacement."""

    path: str
    normalized_shape: tuple[int, ...]
    eps: float
    weight: bool
    bias: bool
    offset: float = 0.0
    permute: tuple[int, ...] = ()
    approximate: bool | None = None  # None: no approximate fold ran (the key is not written)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "normalized_shape": list(self.normalized_shape), "eps": self.eps,
                "weight": self.weight, "bias": self.bias, **({"offset": self.offset} if self.offset else {}),
                **({"permute": list(self.permute)} if self.permute else {}),
                **({} if self.approximate is None else {"approximate": self.approximate})}

    @classmethod
    def from_json(cls, e: object, where: object, at: str) -> SwappedNorm:
        if not isinstance(e, dict) or {"path", "normalized_shape", "eps", "weight", "bias"} - e.keys():
            raise _not_a_report(where, f"{at} must be an object with path, normalized_shape, eps, weight and bias")
        if not isinstance(e["path"], str) or not _sizes(e["normalized_shape"]) or not e["normalized_shape"]:
            raise _not_a_report(where, f"{at} needs a string path and a non-empty list of sizes as normalized_shape")
        offset = e.get("offset", 0.0)
        if not _finite(e["eps"]) or e["eps"] < 0 or not _finite(offset):
            raise _not_a_report(where, f"{at}.eps and .offset must be finite numbers (eps >= 0), got {e['eps']!r}, "
                                       f"{e.get('offset')!r}")
        if not all(isinstance(e.get(k, False), bool) for k in ("weight", "bias", "approximate")):
            raise _not_a_report(where, f"{at}.weight, .bias and .approximate must be true or false")
        permute = e.get("permute", [])
        if not _sizes(permute) or sorted(permute) != list(range(len(permute))):
            raise _not_a_report(where, f"{at}.permute must be a permutation of 0..n-1 (a channels-first norm's), "
                                       f"got {e.get('permute')!r}")
        return cls(e["path"], tuple(e["normalized_shape"]), e["eps"], e["weight"], e["bias"], offset, tuple(permute),
                   e.get("approximate"))


def _finite(value: object) -> bool:
    return _is(value, float) and math.isfinite(value)


@dataclass(frozen=True)
class NamedShape:
    """A parameter by name with its shape: one the fold created, or one of another shape than the stock class's."""

    name: str
    shape: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, e: object, where: object, at: str) -> NamedShape:
        if not isinstance(e, dict) or not isinstance(e.get("name"), str) or not _sizes(e.get("shape")):
            raise _not_a_report(where, f"{at} must be an object with a string name and a list of sizes as shape")
        return cls(e["name"], tuple(e["shape"]))


@dataclass(frozen=True)
class Layout:
    """How a folded model differs from a stock model of its class (``normfold.hf.saving.folded_layout``),
    what ``normfold.from_pretrained`` rebuilds: the swapped norms, norms precomputed into a table (now
    ``nn.Identity``), parameters the fold created, parameters resized (a sliced stream), and whether
    stock transformers builds the same model."""

    swapped: tuple[SwappedNorm, ...]
    identity: tuple[str, ...] = ()
    extra_parameters: tuple[NamedShape, ...] = ()
    resized: tuple[NamedShape, ...] = ()
    stock_compatible: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"swapped": [s.to_json() for s in self.swapped], "identity": list(self.identity),
                "extra_parameters": [e.to_json() for e in self.extra_parameters],
                "resized": [e.to_json() for e in self.resized], "stock_compatible": self.stock_compatible}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: object) -> Layout:
        def entries(key: str) -> list:
            if key not in data:
                raise _not_a_report(where, f"it lacks \"{key}\"")
            if not isinstance(data[key], list):
                raise _not_a_report(where, f"\"{key}\" must be a list, got {type(data[key]).__name__}")
            return data[key]

        swapped = tuple(SwappedNorm.from_json(e, where, f"swapped[{i}]") for i, e in enumerate(entries("swapped")))
        identity = entries("identity")
        if not all(isinstance(p, str) for p in identity):
            raise _not_a_report(where, "\"identity\" must list module paths (strings)")
        named = {key: tuple(NamedShape.from_json(e, where, f"{key}[{i}]") for i, e in enumerate(entries(key)))
                 for key in ("extra_parameters", "resized")}
        return cls(swapped, tuple(identity), **named, stock_compatible=_take(data, "stock_compatible", bool, where))


# ------------------------------------------------------------------------------------- the fold engine's

@dataclass(frozen=True)
class ReportNorm:
    """One norm as the fold engine reported it (``normfold.engine.report.NormEntry``): ``blocker`` (what
    breaks its input's zero mean at ``blocking_path[-1]``) and ``affine_kept`` (why its γ/β stayed) are
    the parts of ``reason`` the model card groups and lists, as fields of their own."""

    path: str
    kind: str
    foldable: bool
    affine_folded: bool
    reason: str
    producers: tuple[str, ...] = ()
    blocking_path: tuple[str, ...] = ()
    blocker: str | None = None
    affine_kept: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "producers": list(self.producers), "blocking_path": list(self.blocking_path)}

    @classmethod
    def from_json(cls, e: Mapping[str, Any], where: object, at: str) -> ReportNorm:
        return cls(_take(e, "path", str, where, at), _take(e, "kind", str, where, at),
                   _take(e, "foldable", bool, where, at), _take(e, "affine_folded", bool, where, at),
                   _take(e, "reason", str, where, at), _strings(e, "producers", where, at),
                   _strings(e, "blocking_path", where, at), _take(e, "blocker", str, where, at, nullable=True),
                   _take(e, "affine_kept", str, where, at, nullable=True))


@dataclass(frozen=True)
class FoldSection:
    """What the fold engine reported (``FoldReport.to_dict``), whose keys the folder report holds at its
    top level: the norms, the plan (with the rotation's choices after ``normfold rotate``), the untied
    parameters, the verification figures, the BatchNorms, the traced calls and what the fold is exact
    for, and the submodules captured when the whole model was not. The counts are the norms'."""

    norms: tuple[ReportNorm, ...] = ()
    plan: Mapping[str, Any] = field(default_factory=dict)
    untied: tuple[str, ...] = ()
    verification: Mapping[str, Any] | None = None
    batchnorms: tuple[Mapping[str, Any], ...] = ()
    num_approximate: int = 0
    traced_calls: tuple[Mapping[str, str], ...] = ()
    exactness_scope: str | None = None
    captured_through: tuple[str, ...] = ()
    whole_model_capture_error: str | None = None
    capture_line: str | None = None

    def counts(self) -> dict[str, int]:
        """``num_norms``, ``num_foldable``, ``num_affine_folded``: what the report says of its norms."""
        return {"num_norms": len(self.norms), "num_foldable": sum(n.foldable for n in self.norms),
                "num_affine_folded": sum(n.affine_folded for n in self.norms)}

    def to_json(self) -> dict[str, Any]:
        return {**self.counts(), "norms": [n.to_json() for n in self.norms],
                "untied": list(self.untied), "plan": dict(self.plan),
                "verification": None if self.verification is None else dict(self.verification),
                "batchnorms": [dict(b) for b in self.batchnorms], "num_approximate": self.num_approximate,
                "traced_calls": [dict(c) for c in self.traced_calls], "exactness_scope": self.exactness_scope,
                "captured_through": list(self.captured_through),
                "whole_model_capture_error": self.whole_model_capture_error, "capture_line": self.capture_line}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: object) -> FoldSection:
        """The fold's keys of ``data`` (a folder report, or ``normfold analyze``'s analysis): every one
        required, and the counts checked against the norms they count."""
        norms = tuple(ReportNorm.from_json(e, where, f"norms[{i}].")
                      for i, e in enumerate(_objects(data, "norms", where)))
        section = cls(norms, _take(data, "plan", dict, where), _strings(data, "untied", where),
                      _take(data, "verification", dict, where, nullable=True),
                      tuple(_objects(data, "batchnorms", where)), _take(data, "num_approximate", int, where),
                      tuple(_objects(data, "traced_calls", where)),
                      _take(data, "exactness_scope", str, where, nullable=True), _strings(data, "captured_through", where),
                      _take(data, "whole_model_capture_error", str, where, nullable=True),
                      _take(data, "capture_line", str, where, nullable=True))
        for key, count in section.counts().items():
            if _take(data, key, int, where) != count:
                raise _not_a_report(where, f"\"{key}\" is {data[key]}, but its norms count {count}")
        return section


FOLD_KEYS = frozenset(FoldSection().to_json())  # the keys of the fold engine's report in a folder report


# ----------------------------------------------------------------------------------- the other sections

@dataclass(frozen=True)
class ModelInfo:
    """The model folded: its class, model type, source folder and parameter count."""

    architecture: str
    model_type: str
    source: str
    parameters: int

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: object) -> ModelInfo:
        return cls(*(_take(data, name, kind, where, "model.") for name, kind in
                     (("architecture", str), ("model_type", str), ("source", str), ("parameters", int))))


@dataclass(frozen=True)
class ApproximateNorms:
    """What an approximate fold replaced (``--approximate``): the norms, and the lowest cosine of the
    whole result on the calibration set (its section, with every norm considered, is
    ``FolderReport.sections["approximate"]``)."""

    norms: tuple[str, ...]
    calibration_min_cosine: float | None

    def to_json(self) -> dict[str, Any]:
        return {"approximate_norms": list(self.norms), "calibration_min_cosine": self.calibration_min_cosine}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: object) -> ApproximateNorms | None:
        if "approximate_norms" not in data:
            return None
        return cls(_strings(data, "approximate_norms", where),
                   _take(data, "calibration_min_cosine", float, where, nullable=True))


@dataclass(frozen=True)
class SkippedFile:
    """A file of the original folder that was not carried over (a link, a pipe, ...), and why."""

    path: str
    reason: str

    @classmethod
    def listed(cls, entries: list[dict[str, str]]) -> tuple[SkippedFile, ...]:
        """``normfold.hf.side_files.copy_side_files``'s ``[{"path", "reason"}]``, typed."""
        return tuple(cls(e["path"], e["reason"]) for e in entries)


# ------------------------------------------------------------------------------------------ the report

@dataclass(frozen=True)
class FolderReport:
    """``normfold_report.json``: what every path that writes a folder (``normfold fold`` in memory or
    streamed, ``normfold rotate``, ``normfold.save_pretrained``) records, and every reader reads.

    ``fold`` is None for ``save_pretrained`` without a ``FoldReport``; ``recipe`` None where the folder
    cannot be re-made; ``model``, ``fold_affine``, ``skipped_files``, ``streaming``, ``calibration``
    (a PCA rotation's text) and ``stock_warning`` are written by the paths that have them.
    ``sections``: the steps after the fold by the name each registered (``approximate`` and ``fuse``,
    null when they did not run, ``rotation``), as their JSON, and ``example_inputs`` (an in-memory
    fold's: which route made the example inputs, ``hf.folder_inputs``). ``files`` and ``digest`` are the seal
    (``normfold.hf.report.seal``), None before it."""

    layout: Layout
    saved_dtype: str
    recipe: Recipe | None = None
    fold: FoldSection | None = None
    sections: Mapping[str, Mapping[str, Any] | None] = field(default_factory=dict)
    approximate: ApproximateNorms | None = None
    model: ModelInfo | None = None
    fold_affine: bool | None = None
    skipped_files: tuple[SkippedFile, ...] | None = None
    streaming: Mapping[str, float] | None = None
    calibration: Mapping[str, Any] | None = None
    stock_warning: str | None = None
    files: Mapping[str, str] | None = None
    digest: str | None = None

    @property
    def verification(self) -> Mapping[str, Any] | None:
        return None if self.fold is None else self.fold.verification

    @property
    def num_approximate(self) -> int:
        return 0 if self.fold is None else self.fold.num_approximate

    def with_verification(self, verification: Mapping[str, Any]) -> FolderReport:
        """This report with the fold's verification figures replaced (a streamed fold's, proved after writing)."""
        assert self.fold is not None, "only a fold's report has verification figures"
        return replace(self, fold=replace(self.fold, verification=dict(verification)))

    def with_section(self, name: str, section: Mapping[str, Any] | None) -> FolderReport:
        """This report with the section of the step registered as ``name`` set (None: it did not run)."""
        return replace(self, sections={**self.sections, name: None if section is None else dict(section)})

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to ``normfold_report.json`` (optional parts only where they are set)."""
        optional = {"model": None if self.model is None else asdict(self.model), "fold_affine": self.fold_affine,
                    "skipped_files": None if self.skipped_files is None else [asdict(s) for s in self.skipped_files],
                    "streaming": None if self.streaming is None else dict(self.streaming),
                    "calibration": None if self.calibration is None else dict(self.calibration),
                    "stock_warning": self.stock_warning, "files": None if self.files is None else dict(self.files),
                    "digest": self.digest}
        return {"schema_version": REPORT_SCHEMA, **({} if self.fold is None else self.fold.to_json()),
                **{name: None if s is None else dict(s) for name, s in self.sections.items()},
                **self.layout.to_json(), "saved_dtype": self.saved_dtype,
                **({} if self.approximate is None else self.approximate.to_json()),
                "recipe": None if self.recipe is None else self.recipe.to_dict(),
                **{key: value for key, value in optional.items() if value is not None}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: object = "normfold_report.json") -> FolderReport:
        """The report in ``data`` (read from ``where``), every section checked: CheckpointError naming
        ``where`` and the first key that is missing or of another type, or the schema version."""
        check_schema(data, where)
        fold = FoldSection.from_json(data, where) if "norms" in data else None
        if fold is None and FOLD_KEYS & data.keys():
            raise _not_a_report(where, f"it lacks \"norms\" but has {', '.join(sorted(FOLD_KEYS & data.keys()))}")
        recipe = _take(data, "recipe", dict, where, nullable=True)
        model = _take(data, "model", dict, where, default=None)
        skipped = _objects(data, "skipped_files", where, default=None)
        report = cls(Layout.from_json(data, where), _take(data, "saved_dtype", str, where),
                     None if recipe is None else Recipe.from_dict(recipe), fold,
                     approximate=ApproximateNorms.from_json(data, where),
                     model=None if model is None else ModelInfo.from_json(model, where),
                     fold_affine=_take(data, "fold_affine", bool, where, default=None),
                     skipped_files=None if skipped is None else tuple(
                         SkippedFile(_take(s, "path", str, where, "skipped_files."),
                                     _take(s, "reason", str, where, "skipped_files.")) for s in skipped),
                     streaming=_take(data, "streaming", dict, where, default=None),
                     calibration=_take(data, "calibration", dict, where, default=None),
                     stock_warning=_take(data, "stock_warning", str, where, default=None),
                     files=_take(data, "files", dict, where, default=None),
                     digest=_take(data, "digest", str, where, default=None))
        known = {"schema_version", *report.to_json()}
        sections = {name: _take(data, name, dict, where, nullable=True) for name in data.keys() - known}
        return replace(report, sections=sections)
