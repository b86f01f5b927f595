"""Proving a streamed fold without loading either model whole: the shell, every block of every
stack the fold touched (:mod:`.blocks`), every other tensor as a copy, and, for ``normfold verify``,
every stored tensor against the fold re-derived from the original."""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..._progress import progress
from ..load import CheckpointError, _first_line, check_model_dir
from ..output_dir import REPORT_JSON
from ..saved_weights import compare_weights, not_compared, same_plan, skipped, why_not_rederivable
from ..saving import DTYPES
from .blocks import (Call, StreamMap, call_block, check_loaded_block, check_shell, compare_copies, first_output, hidden_states,
                     load_block, random_stream, stacks_of)
from .checkpoint import SAFETENSORS_DTYPES, TORCH_DTYPES, Checkpoint, stored_dtype_name
from .planning import meta_skeleton, plan_for_checkpoint
from .rewrite import CheckpointRewrite


def verify_by_blocks(orig_dir: str | os.PathLike, folded_dir: str | os.PathLike, report: dict[str, Any] | None = None,
                     *, dtype: str | None = None, trust_remote_code: bool = False, check_weights: bool = True,
                     stream_map: StreamMap | None = None, step: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Prove a folded checkpoint equal to its original without loading either whole (the argument is
    the comment at the top of :mod:`normfold.hf.streaming.blocks`): the shell, every block of every
    stack (run on the original's stream, or compared as a copy when unchanged), and every remaining
    tensor as a copy; then every stored tensor against the fold re-derived from the original
    (:func:`check_streamed_weights`, under ``weights``), which sees what running a piece cannot: in
    a bf16 post-LN BERT a 1.5x MLP weight moves its block's output less than bf16 itself does.

    ``dtype``: the dtype the folded weights were stored in (default: read from the checkpoint).
    Each piece run (``shell``, each of ``blocks``) carries its ``own_error``, ``tolerance``,
    ``tolerance_rule`` and ``ok``; ``ok`` only when every piece is within its own tolerance and
    every tensor of both folders was checked, and the weight check did not fail (a skipped one,
    ``weights["ok"]`` None, does not count). ``tolerance`` is the tightest of the pieces',
    ``tolerance_rule`` names the piece closest to its bound, ``why`` says what failed.
    ``check_weights=False`` skips the weight check (``fold_checkpoint``: the tensors were just
    written by the same code a re-derivation runs, so it would re-read both checkpoints whole to
    compare that code with itself; ``normfold verify`` runs it).
    ``stream_map``: a transform of the stream after the fold (``normfold rotate``: x ↦ x·Q); every
    piece then compares the folded model's stream with that of the (centered) original's, and the
    shell holds the parameters the report lists under ``extra_parameters``.
    Memory: the shell (embeddings, head, one block per stack) in float64, then one block at a time;
    the weight check holds one group of tensors the fold rewrites together.
    """
    orig_dir, folded_dir = check_model_dir(orig_dir), check_model_dir(folded_dir)
    if report is None:
        report = json.loads((folded_dir / REPORT_JSON).read_text())
    stored_name = dtype or stored_dtype_name(folded_dir)
    if stored_name not in DTYPES:
        raise CheckpointError(f"dtype must be one of {', '.join(DTYPES)}, got {stored_name!r}")
    stored = DTYPES[stored_name]
    swapped = report["swapped"]
    skeleton = meta_skeleton(orig_dir, trust_remote_code)
    stacks = stacks_of(skeleton, swapped)
    step("checking the embeddings, final norm and head in float64")
    try:
        shell, calls = check_shell(orig_dir, folded_dir, swapped, {s: c for s, (_, c) in stacks.items()},
                                   stored_dtype=stored, trust_remote_code=trust_remote_code, stream_map=stream_map,
                                   extra_parameters=[e["name"] for e in report.get("extra_parameters", [])])
    except Exception as err:  # a model that cannot run cut short: not proved, so not ok
        shell, calls = {"block": "model cut to its first block", "max_rel_error": math.nan, "ok": False, "keys": [],
                        "problems": [f"could not run the model cut to one block per stack: {_first_line(err)}"]}, {}
    orig, folded = Checkpoint(orig_dir), Checkpoint(folded_dir)
    problems, checks, covered, copies = list(shell["problems"]), [], set(shell["keys"]), 0
    for stack, (n, centered) in stacks.items():
        step(f"checking the {n} blocks of {stack} in float64")
        stack_checks, stack_problems, stack_keys, stack_copies = _check_stack(
            skeleton, orig, folded, [f"{stack}.{i}" for i in range(n)], centered, calls.get(stack), swapped, stored,
            stream_map)
        checks += stack_checks
        problems += stack_problems
        covered |= stack_keys
        copies += stack_copies
    step("comparing the tensors the fold does not change")
    rest = sorted((orig.meta.keys() | folded.meta.keys()) - covered)
    problems += [f"{key}: differs from the original (or is missing on one side), though no checked piece holds it"
                 for key in compare_copies(orig, folded, rest)]
    copies += len(rest)
    if check_weights:
        step("re-deriving the fold and comparing every stored tensor")
        weights = check_streamed_weights(orig_dir, folded, report, trust_remote_code=trust_remote_code)
    else:
        weights = skipped(why_not_rederivable(report)  # a rotated folder: re-derivation cannot see Q either
                          or "at fold time the tensors were just written by the streaming code a re-derivation "
                          "would run again; `normfold verify ORIG OUT` re-derives and compares them")
    pieces = [shell, *checks]
    errors = [c["max_rel_error"] for c in pieces]
    ratios = [c["max_input_mean_ratio"] for c in checks if c["max_input_mean_ratio"] is not None]
    verification = {
        "ok": not problems and all(c["ok"] for c in pieces) and weights["ok"] is not False,
        "max_rel_error": math.nan if any(math.isnan(e) for e in errors) else max(errors),
        "max_input_mean_ratio": max(ratios) if ratios else None,
        "tolerance": min((c["tolerance"] for c in pieces if "tolerance" in c), default=math.nan),
        "tolerance_rule": _tolerance_rule(pieces), "stored_dtype": stored_name, "num_runs": len(checks) + 1,
        "blocks": checks, "shell": {k: v for k, v in shell.items() if k != "keys"}, "copied_tensors": copies,
        "problems": problems, "weights": weights}
    verification["why"] = None if verification["ok"] else failure_summary(verification)
    return verification


def _check_stack(skeleton: nn.Module, orig: Checkpoint, folded: Checkpoint, paths: list[str], centered: bool,
                 call: Call | None, swapped: list[dict[str, Any]], stored: torch.dtype,
                 stream_map: StreamMap | None = None) -> tuple[list[dict[str, Any]], list[str], set[str], int]:
    """Every block of one stack (``paths``, in order) on the original's stream: each block whose
    tensors changed (every block of a centered stack) is checked, one that is a copy of the original
    only run to carry the stream on. Returns the checks, the problems, the checkpoint keys the blocks
    hold and how many of them were compared as copies."""
    keys = {path: sorted(k for k in orig.meta.keys() | folded.meta.keys() if k.startswith(path + "."))
            for path in paths}
    run = [path for path in paths if centered or stream_map or compare_copies(orig, folded, keys[path])]
    copies = sum(len(keys[path]) for path in paths if path not in run)
    checks, problems = [], []
    x = hidden_states(call) if call else random_stream(skeleton, paths[0])  # no shell run: its problem is listed
    needed = paths[:paths.index(run[-1]) + 1] if run else []  # past the last changed block, nothing to check
    for path in progress(needed, desc=f"checking {paths[0].rpartition('.')[0]}", unit="block"):
        try:
            if path in run:
                result, x = check_loaded_block(skeleton, orig, folded, path, swapped, centered, call, x, stored,
                                               stream_map)
                checks.append(result)
            else:  # a copy: only the stream the next block reads is needed
                with torch.no_grad():
                    x = first_output(call_block(load_block(skeleton, orig, path), call, x))
        except Exception as err:  # e.g. a block that cannot run alone: not proved, so not ok
            later = [p for p in run if paths.index(p) > paths.index(path)]
            problems.append(f"could not check {path}: {_first_line(err)}"
                            + (f" (so neither {', '.join(later)}, which read its output)" if later else ""))
            break
    return checks, problems, {k for path in paths for k in keys[path]}, copies


def check_streamed_weights(orig_dir: Path, folded: Checkpoint, report: dict[str, Any], *,
                           trust_remote_code: bool = False) -> dict[str, Any]:
    """Every tensor of ``folded`` against the streaming fold re-derived from the original checkpoint.

    The fold is re-run as ``fold_checkpoint`` ran it: :func:`plan_for_checkpoint` with the
    ``fold_affine`` and saved dtype the report records, then ``CheckpointRewrite.compute`` group by group
    (one group of tensors in memory at a time), each tensor compared with the stored one by
    :func:`normfold.hf.saved_weights.compare_weights` (within one ulp of the stored dtype; the
    key sets must be equal). Skipped, with the reason, when the report lacks what the
    re-derivation needs or records another plan than the one derived (another normfold, another
    original); a re-derivation that fails is a failure (nothing was compared).
    """
    reason = why_not_rederivable(report)
    if reason:
        return skipped(reason)
    out_dtype = _rederived_out_dtype(folded, report["saved_dtype"])
    try:
        derived_report, skeleton, original = plan_for_checkpoint(
            orig_dir, fold_affine=bool(report["fold_affine"]), trust_remote_code=trust_remote_code,
            stored_dtype=out_dtype)
        if not same_plan(derived_report.plan, report["plan"]):
            return skipped("the plan this normfold derives from the original differs from the one the report "
                           "records (folded by another normfold version, or from another original): the weights "
                           "cannot be re-derived")
        derived = _DerivedTensors(CheckpointRewrite(derived_report.plan, skeleton, original, out_dtype))
        names = sorted(folded.meta, key=derived.group_order)  # a group's keys in a row: each group computed once
        return compare_weights(derived, names, folded.read, {})
    except Exception as err:  # e.g. an original that no longer plans: nothing proved, so not ok
        return not_compared(f"could not re-derive the fold from the original and compare: {_first_line(err)}")


def _rederived_out_dtype(folded: Checkpoint, saved_dtype: str) -> torch.dtype | None:
    """The ``out_dtype`` the fold wrote with: the saved dtype when ``folded`` stores every floating
    tensor in it (a fold with ``--dtype``, or of an original in one dtype, where both readings
    agree), else None (a mixed-dtype original folded without ``--dtype`` keeps each tensor's)."""
    floating = {d for d, _ in folded.meta.values() if TORCH_DTYPES[d].is_floating_point}
    return DTYPES[saved_dtype] if floating <= {SAFETENSORS_DTYPES[DTYPES[saved_dtype]]} else None


class _DerivedTensors(Mapping):
    """The streaming fold's output tensors by key, computed on first access by ``CheckpointRewrite.compute``,
    which yields a key's whole group; only the last group is kept (ask for a group's keys in a row)."""

    def __init__(self, rewrite: CheckpointRewrite) -> None:
        self.rewrite = rewrite
        self.names = [*rewrite.checkpoint.meta, *(k for k in rewrite.new_keys if k not in rewrite.checkpoint.meta)]
        self.known = set(self.names)
        self.group: dict[str, torch.Tensor] = {}

    def group_order(self, key: str) -> tuple[str, str]:
        """Sort key putting the keys of one group next to each other."""
        return self.rewrite.group_of.get(key, key), key

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.known:
            raise KeyError(key)
        if key not in self.group:
            self.group = self.rewrite.compute(key)
        return self.group[key]

    def __contains__(self, key: object) -> bool:
        return key in self.known

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _closest_to_bound(pieces: list[dict[str, Any]]) -> dict[str, Any]:
    """The piece with the largest error / tolerance (NaN or unmeasured: infinite)."""
    def ratio(piece: dict[str, Any]) -> float:
        error, tolerance = piece["max_rel_error"], piece.get("tolerance", math.nan)
        if math.isnan(error) or math.isnan(tolerance):
            return math.inf
        return error / tolerance if tolerance > 0 else math.inf

    return max(pieces, key=ratio)


def _tolerance_rule(pieces: list[dict[str, Any]]) -> str:
    """The verification's rule in words, with the numbers of the piece closest to its bound."""
    closest = _closest_to_bound(pieces)
    text = "each piece (the model cut to its first blocks, each block run) within its own tolerance"
    if "tolerance_rule" not in closest:
        return f"{text}; {closest['block']} was not measured"
    return (f"{text}; closest to its bound: {closest['block']}, error {closest['max_rel_error']:.1e}, tolerance "
            f"{closest['tolerance']:.1e} = {closest['tolerance_rule']}")


def failure_summary(verification: dict[str, Any]) -> str:
    """One line saying why a verification failed."""
    weights = verification.get("weights") or {}
    stored = f"stored weights: {weights['why']}" if weights.get("ok") is False else None
    pieces = [verification["shell"], *verification["blocks"]]
    if verification["problems"]:
        outputs = f"float64 check failed: {verification['problems'][0]}"
    elif all(piece["ok"] for piece in pieces):
        return stored
    else:
        worst = _closest_to_bound(pieces)
        outputs = (f"float64 check failed: {worst['block']} relative error {worst['max_rel_error']:.1e} > tolerance "
                   f"{worst.get('tolerance', math.nan):.1e} = {worst.get('tolerance_rule', 'not measured')}")
    return outputs if stored is None else f"{outputs}; {stored}"


