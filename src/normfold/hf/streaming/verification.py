"""Proving a streamed fold without loading either model whole: the shell, every block of every
stack the fold touched (:mod:`.blocks`), every other tensor as a copy. (``normfold verify`` also
re-makes the folder and compares every stored tensor: :mod:`normfold.hf.judge`.)"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..._progress import progress
from ..._text import first_line
from ..load import CheckpointError, check_model_dir
from ..folder_report import FolderReport, SwappedNorm
from ..report import read_folder_report
from ..saving import DTYPES
from .blocks import (Call, StreamMap, affine_moved_out, call_block, check_loaded_block, check_shell, compare_copies,
                     first_output, hidden_states, load_block, random_stream, runs_in_float32, stacks_of)
from .checkpoint import Checkpoint, StoredKeys, stored_dtype_name
from .planning import meta_skeleton


def verify_by_blocks(orig_dir: str | os.PathLike, folded_dir: str | os.PathLike, report: FolderReport | None = None,
                     *, dtype: str | None = None, trust_remote_code: bool = False,
                     stream_map: StreamMap | None = None, step: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Prove a folded checkpoint equal to its original without loading either whole (the argument is
    the comment at the top of :mod:`normfold.hf.streaming.blocks`): the shell, every block of every
    stack (run on the original's stream, or compared as a copy when unchanged), and every remaining
    tensor as a copy. Running a piece cannot see a change smaller than the stored dtype's own error
    (in a bf16 post-LN BERT a 1.5x MLP weight moves its block's output less than bf16 itself does):
    ``normfold verify`` also compares every stored tensor with a re-made fold (:mod:`normfold.hf.judge`).

    ``dtype``: the dtype the folded weights were stored in (default: read from the checkpoint).
    Each piece run (``shell``, each of ``blocks``) carries its ``own_error``, ``tolerance``,
    ``tolerance_rule`` and ``ok``; ``ok`` only when every piece is within its own tolerance and
    every tensor of both folders was checked. ``tolerance`` is the tightest of the pieces',
    ``tolerance_rule`` names the piece closest to its bound, ``why`` says what failed.
    ``stream_map``: a transform of the stream after the fold (``normfold rotate``: x ↦ x·Q); every
    piece then compares the folded model's stream with that of the (centered) original's, and the
    shell holds the parameters the report lists under ``extra_parameters``.
    Memory: the shell (embeddings, head, one block per stack) in float64, then one block at a time.
    """
    orig_dir, folded_dir = check_model_dir(orig_dir), check_model_dir(folded_dir)
    if report is None:
        report = read_folder_report(folded_dir)
    stored_name = dtype or stored_dtype_name(folded_dir)
    if stored_name not in DTYPES:
        raise CheckpointError(f"dtype must be one of {', '.join(DTYPES)}, got {stored_name!r}")
    stored = DTYPES[stored_name]
    swapped = report.layout.swapped
    plan = report.fold.plan
    skeleton = meta_skeleton(orig_dir, trust_remote_code)
    stacks = stacks_of(skeleton, swapped, [c["fqn"] for c in plan.get("center", [])])
    # γ/β the fold moved out of a stack (into the head): its blocks are compared without them, the shell holds its last block
    affine_folds = plan.get("affine_fold", [])
    moved = {stack: affine_moved_out(affine_folds, stack) for stack in stacks}
    shell_blocks = {stack: n - 1 for stack, (n, _) in stacks.items() if moved[stack]}
    step("checking the embeddings, final norm and head in float64")
    try:
        shell, calls = check_shell(orig_dir, folded_dir, swapped, {s: c for s, (_, c) in stacks.items()},
                                   stored_dtype=stored, trust_remote_code=trust_remote_code, stream_map=stream_map,
                                   extra_parameters=[e.name for e in report.layout.extra_parameters],
                                   shell_blocks=shell_blocks)
    except Exception as err:  # a model that cannot run cut short: not proved, so not ok
        why = f"could not run the model cut to one block per stack: {first_line(err)}"
        if runs_in_float32(orig_dir, list(stacks), trust_remote_code):
            why = (f"the model cannot run in float64 ({type(err).__name__}: {first_line(err)}), and a streamed fold "
                   "proves every piece in float64 (the in-memory fold falls back to float32): fold it in memory")
        shell, calls = {"block": "model cut to its first block", "max_rel_error": math.nan, "ok": False, "keys": [],
                        "problems": [why]}, {}
    orig, folded = StoredKeys(skeleton, Checkpoint(orig_dir)), StoredKeys(skeleton, Checkpoint(folded_dir))
    problems, checks, covered, copies = list(shell["problems"]), [], set(shell["keys"]), 0
    problems += [f"{name}: the fold moved this γ/β out of {stack} from a block other than its last, whose output the "
                 "next block reads: the pieces cannot prove that" for stack, names in moved.items() for name in names
                 if not name.startswith(f"{stack}.{stacks[stack][0] - 1}.")]
    for stack, (n, centered) in stacks.items():
        step(f"checking the {n} blocks of {stack} in float64")
        stack_checks, stack_problems, stack_keys, stack_copies = _check_stack(
            skeleton, orig, folded, [f"{stack}.{i}" for i in range(n)], centered, calls.get(stack), swapped, stored,
            stream_map, moved[stack])
        checks += stack_checks
        problems += stack_problems
        covered |= stack_keys
        copies += stack_copies
    step("comparing the tensors the fold does not change")
    rest = sorted((orig.checkpoint.meta.keys() | folded.checkpoint.meta.keys()) - covered)
    problems += [f"{key}: differs from the original (or is missing on one side), though no checked piece holds it"
                 for key in compare_copies(orig.checkpoint, folded.checkpoint, rest)]
    copies += len(rest)
    pieces = [shell, *checks]
    errors = [c["max_rel_error"] for c in pieces]
    ratios = [c["max_input_mean_ratio"] for c in checks if c["max_input_mean_ratio"] is not None]
    verification = {
        "ok": not problems and all(c["ok"] for c in pieces),
        "max_rel_error": math.nan if any(math.isnan(e) for e in errors) else max(errors),
        "max_input_mean_ratio": max(ratios) if ratios else None,
        "tolerance": min((c["tolerance"] for c in pieces if "tolerance" in c), default=math.nan),
        "tolerance_rule": _tolerance_rule(pieces), "stored_dtype": stored_name, "num_runs": len(checks) + 1,
        "blocks": checks, "shell": {k: v for k, v in shell.items() if k != "keys"}, "copied_tensors": copies,
        "problems": problems}
    verification["why"] = None if verification["ok"] else failure_summary(verification)
    return verification


def _check_stack(skeleton: nn.Module, orig: StoredKeys, folded: StoredKeys, paths: list[str], centered: bool,
                 call: Call | None, swapped: Sequence[SwappedNorm], stored: torch.dtype,
                 stream_map: StreamMap | None = None,
                 moved_affine: list[str] = ()) -> tuple[list[dict[str, Any]], list[str], set[str], int]:
    """Every block of one stack (``paths``, in order) on the original's stream: each block whose
    tensors changed (every block of a centered stack) is checked, one that is a copy of the original
    only run to carry the stream on. Returns the checks, the problems, the checkpoint keys the blocks
    hold and how many of them were compared as copies. ``moved_affine``: the γ/β names whose affine
    the fold moved out of the stack (each block is compared with the original without those it holds)."""
    keys = {path: _block_keys(skeleton, path, orig, folded) for path in paths}
    run = [path for path in paths if centered or stream_map or compare_copies(orig.checkpoint, folded.checkpoint,
                                                                               keys[path])]
    copies = sum(len(keys[path]) for path in paths if path not in run)
    checks, problems = [], []
    try:
        x = hidden_states(call) if call else random_stream(skeleton, paths[0])  # no shell run: its problem is listed
    except CheckpointError as err:  # no stream to run the stack on (a conv stack): not proved, so not ok
        return [], [f"could not check {paths[0].rpartition('.')[0]}: {first_line(err)}"], \
            {k for path in paths for k in keys[path]}, copies
    needed = paths[:paths.index(run[-1]) + 1] if run else []  # past the last changed block, nothing to check
    for path in progress(needed, desc=f"checking {paths[0].rpartition('.')[0]}", unit="block"):
        try:
            if path in run:
                result, x = check_loaded_block(skeleton, orig, folded, path, swapped, centered, call, x, stored,
                                               stream_map, moved_affine)
                checks.append(result)
            else:  # a copy: only the stream the next block reads is needed
                with torch.no_grad():
                    x = first_output(call_block(load_block(skeleton, orig, path), call, x))
        except Exception as err:  # e.g. a block that cannot run alone: not proved, so not ok
            later = [p for p in run if paths.index(p) > paths.index(path)]
            problems.append(f"could not check {path}: {first_line(err)}"
                            + (f" (so neither {', '.join(later)}, which read its output)" if later else ""))
            break
    return checks, problems, {k for path in paths for k in keys[path]}, copies


def _block_keys(skeleton: nn.Module, path: str, orig: StoredKeys, folded: StoredKeys) -> list[str]:
    """The keys of both checkpoints that store the tensors of the block at ``path``."""
    names = [f"{path}.{name}" for name in skeleton.get_submodule(path).state_dict()]
    return sorted({key for stored in (orig, folded) for key in map(stored.key, names) if key is not None})


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
    text = "each piece (the model cut to one block per stack, each block run) within its own tolerance"
    if "tolerance_rule" not in closest:
        return f"{text}; {closest['block']} was not measured"
    return (f"{text}; closest to its bound: {closest['block']}, error {closest['max_rel_error']:.1e}, tolerance "
            f"{closest['tolerance']:.1e} = {closest['tolerance_rule']}")


def failure_summary(verification: dict[str, Any]) -> str:
    """One line saying why a verification failed (None when it did not)."""
    pieces = [verification["shell"], *verification["blocks"]]
    if verification["problems"]:
        return f"float64 check failed: {verification['problems'][0]}"
    if all(piece["ok"] for piece in pieces):
        return None
    worst = _closest_to_bound(pieces)
    return (f"float64 check failed: {worst['block']} relative error {worst['max_rel_error']:.1e} > tolerance "
            f"{worst.get('tolerance', math.nan):.1e} = {worst.get('tolerance_rule', 'not measured')}")


