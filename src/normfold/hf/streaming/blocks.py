"""Proving a streamed fold piece by piece in float64: one residual block at a time, and the model cut
to the first block of each stack (the shell: embeddings, final norm, head). The argument is in the
comment below; :mod:`.verification` puts the pieces together."""
from __future__ import annotations

import contextlib
import copy
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...engine.math import center
from ...engine.verify import (cast_floats, default_dtype_of, flatten_outputs, measured_tolerance, output_error,
                            outputs_own_error, watch_rms_inputs)
from ..inputs import example_inputs_for
from ..load import CheckpointError, check_model_dir, load_config, model_class_for
from ..folder_report import SwappedNorm
from ..report import read_folder_report
from ..saving import DTYPES, swap_in_rmsnorm
from .checkpoint import Checkpoint, StoredKeys, stored_dtype_name
from .planning import NORM_TYPES, meta_skeleton

# The fold never runs the whole model, so it is proved in pieces, each in float64 and alone. In a
# folded Pre-LN model the residual stream is the original's with its mean removed: with
# P = I − 11ᵀ/n, folded stream = P·stream. A stack (the outermost ModuleList holding norms) is
# "centered" when it holds a swapped norm; in the others the stream is the original's. Hence
#   blocks: folded_block(P·x) = P·block(x) in a centered stack, folded_block(x) = block(x) in the
#           others (where a kept norm's γ/β may have moved into the next layer); a block whose
#           tensors all equal the original's is compared as a copy instead. Where a norm's γ/β moved
#           out of the stack (a post-LN BERT's last output LayerNorm into the head), the block is
#           compared with the original block without that affine: folded_block(x) = block₋γβ(x);
#   shell:  the model cut to one block of each stack gives the original's outputs, and the
#           stream entering each stack is P·(the original's) or the original's; the block is the
#           first, or the last where γ/β moved out of the stack (so the tail reads, on both sides,
#           the output it was folded for);
#   copies: every other tensor equals the original's in the saved dtype.
# Together: the stream enters every stack in its relation, each block keeps it, so the stack hands
# the shell's tail (final norm, head) what it maps to the original output.
#
# Each block runs on the original's own stream: the hidden states the shell saw entering the stack,
# carried block by block through the original blocks. An N(0, 1) stream can be far larger than a
# real one, which hides what a block adds to it: in a tiny random GPT-2 a 1.5x MLP weight changed
# such a block's output by 2.9e-3, below bf16's unit roundoff, and by 0.11 on the real stream.
# The folded weights are rounded to the stored dtype, so each piece (the shell, every block run) is
# judged by its own measured tolerance (normfold.engine.verify.measured_tolerance): its error must be
# at most 2x the error the original piece itself makes when cast to that dtype and run in it on the
# same inputs, plus one rounding.

Call = tuple[tuple, dict]  # the (args, kwargs) a stack's first block is called with inside the model
StreamMap = Callable[[torch.Tensor], torch.Tensor]  # the original's stream -> the folded model's (x ↦ x·Q)


def check_block(orig_dir: str | os.PathLike, folded_dir: str | os.PathLike, block_path: str, *,
                swapped: Sequence[SwappedNorm] | None = None, centered: bool = True, call: Call | None = None,
                x: torch.Tensor | None = None, stored_dtype: torch.dtype | None = None, batch: int = 2, seq: int = 16,
                seed: int = 0, trust_remote_code: bool = False, moved_affine: list[str] | None = None) -> dict[str, Any]:
    """Compare one residual block of a folded checkpoint with the original, in float64, loading
    only that block's tensors, and judge the error by the block's own error in ``stored_dtype``.

    ``centered`` (a Pre-LN block the fold centered): the folded residual stream is the original's
    with its mean removed (P = I − 11ᵀ/n), so folded_block(P·x) = P·block(x); the error is that of
    folded_block(P·x) against P·block(x) (:func:`normfold.engine.verify.output_error`, as every proof
    measures it). Otherwise folded_block(x) = block(x).
    ``x``: the hidden states the original block reads (default: N(0, 1) of the call's shape, or
    ``(batch, seq, width)``). ``call``: the other arguments the model passes the block (masks,
    rotary tables, ALiBi; :func:`check_shell` records them), x replacing the hidden states.
    ``stored_dtype`` (default: the folded checkpoint's): the result's ``tolerance`` is
    ``measured_tolerance(own_error, stored_dtype)``, ``own_error`` being the original block cast to
    that dtype and run in it (x and the call's float tensors cast too) against float64; ``ok`` says
    whether the error is within it. Also returns the worst |mean|/rms of the RMSNorm inputs.
    ``swapped``: the report's swapped norms (default: read from ``folded_dir``'s report).
    ``moved_affine``: the γ/β names of the block's norms whose affine the fold moved out of its stack
    (default: read from the report's plan, :func:`affine_moved_out`); the block is compared with the
    original without them.
    """
    orig_dir, folded_dir = check_model_dir(orig_dir), check_model_dir(folded_dir)
    if swapped is None or moved_affine is None:
        report = read_folder_report(folded_dir)
        swapped = report.layout.swapped if swapped is None else swapped
        if moved_affine is None:
            moved_affine = affine_moved_out(report.fold.plan.get("affine_fold", []), block_path.rpartition(".")[0])
    stored = stored_dtype or DTYPES[stored_dtype_name(folded_dir)]
    skeleton = meta_skeleton(orig_dir, trust_remote_code)
    if x is None:
        x = random_stream(skeleton, block_path, call, batch=batch, seq=seq, seed=seed)
    result, _ = check_loaded_block(skeleton, StoredKeys(skeleton, Checkpoint(orig_dir)),
                                   StoredKeys(skeleton, Checkpoint(folded_dir)), block_path, swapped, centered, call, x,
                                   stored, moved_affine=moved_affine)
    return result


def check_loaded_block(skeleton: nn.Module, orig: StoredKeys, folded: StoredKeys, block_path: str,
                 swapped: Sequence[SwappedNorm], centered: bool, call: Call | None, x: torch.Tensor,
                 stored: torch.dtype, stream_map: StreamMap | None = None,
                 moved_affine: list[str] = ()) -> tuple[dict[str, Any], torch.Tensor]:
    """:func:`check_block` on open checkpoints (with the keys of the skeleton's tensors); also returns the original block's output on ``x``
    (the stream the next block reads). One block in float64 in memory at a time. ``stream_map``: the
    folded model's stream is ``stream_map`` of the (centered) original's (a rotation: x·Q).
    ``moved_affine``: γ/β names whose affine moved out of the stack; those inside this block are
    removed from the original block before it gives the reference (not the stream it returns)."""
    project = folded_stream(centered, stream_map)
    with torch.no_grad():
        original = load_block(skeleton, orig, block_path)
        stream = first_output(call_block(original, call, x))
        if _remove_affine(original, block_path, moved_affine):  # the reference: the block without that γ/β
            ref = project(first_output(call_block(original, call, x)))
        else:
            ref = project(stream)
        own = _own_error([ref], original, lambda m, dt: [project(first_output(call_block(m, cast_floats(call, dt), x.to(dt))).double())],
                         stored)
        del original
        block = load_block(skeleton, folded, block_path, swapped)
        # |mean|/rms of every RMSNorm input: 0 when exactly folded (not after a rotation: x·Q has a mean)
        _, ratios = watch_rms_inputs(block, None) if stream_map is None else (None, [])
        out = first_output(call_block(block, call, project(x)))
    error = output_error(ref, out).error
    return {"block": block_path, "centered": centered, "max_rel_error": error, **_judged(error, own, stored),
            "max_input_mean_ratio": max(ratios) if ratios else None}, stream


def _remove_affine(block: nn.Module, block_path: str, names: list[str]) -> bool:
    """Drop from ``block`` the γ/β among ``names`` (full names) that it holds, as a norm without
    that affine computes them (γ = 1, β = 0); whether it held any."""
    prefix = block_path + "."
    inside = [name[len(prefix):] for name in names if name.startswith(prefix)]
    for name in inside:
        owner_path, _, attr = name.rpartition(".")
        setattr(block.get_submodule(owner_path), attr, None)
    return bool(inside)


def affine_moved_out(affine_folds: list[dict[str, Any]], stack: str) -> list[str]:
    """The γ/β names of the norms of ``stack`` whose affine a plan's ``affine_fold`` entries (as the
    report lists them) moved into a layer outside the stack: a post-LN BERT's last output LayerNorm
    into its head. The folded stack then hands on its output without that γ/β."""
    def inside(name: str) -> bool:
        return name.startswith(stack + ".")
    return sorted({name for step in affine_folds if inside(step["norm_path"]) and not inside(step["weight_fqn"])
                   for name in (step["gamma_fqn"], step["beta_fqn"]) if name})


def folded_stream(centered: bool, stream_map: StreamMap | None = None) -> StreamMap:
    """The folded model's stream as a function of the original's: P·x in a centered stack, then
    ``stream_map`` (a rotation after the fold), else x."""
    def project(t: torch.Tensor) -> torch.Tensor:
        t = center(t, -1) if centered else t
        return t if stream_map is None else stream_map(t)
    return project


def load_block(skeleton: nn.Module, stored: StoredKeys, block_path: str,
               swapped: Sequence[SwappedNorm] = ()) -> nn.Module:
    """The block at ``block_path`` in float64 with the checkpoint's tensors (only its own read, by the
    keys ``stored`` gives the skeleton's names), the ``swapped`` norms inside it replaced by RMSNorms.
    Buffers not saved with the weights (GPT-Neo's causal mask) are made as loading makes them."""
    prefix = block_path + "."
    block = copy.deepcopy(skeleton.get_submodule(block_path))
    _make_unsaved_buffers(skeleton, block)
    state = {}
    for name in block.state_dict():
        key = stored.key(prefix + name)
        if key is None:
            raise CheckpointError(f"{stored.checkpoint.folder} has no tensor for {prefix + name}")
        state[name] = stored.checkpoint.read(key).double()
    block.load_state_dict(state, strict=True, assign=True)
    block = block.double().eval()
    for entry in swapped:
        if entry.path.startswith(prefix):
            swap_in_rmsnorm(block, replace(entry, path=entry.path[len(prefix):]))
    return block


def _make_unsaved_buffers(skeleton: nn.Module, block: nn.Module) -> None:
    """Real values for ``block``'s buffers that are on the meta device (built from the config, never
    saved): as transformers' loading makes them, empty then set by the model's ``_init_weights`` for
    each module holding one (its parameters, still on meta, are left alone)."""
    init = getattr(skeleton, "_init_weights", None)
    for module in block.modules():
        saved = module.state_dict()
        unsaved = [(name, buffer) for name, buffer in module.named_buffers(recurse=False)
                   if buffer.is_meta and name not in saved]
        for name, buffer in unsaved:
            module.register_buffer(name, torch.empty_like(buffer, device="cpu"), persistent=False)
        if unsaved and init is not None:
            init(module)


def random_stream(skeleton: nn.Module, block_path: str, call: Call | None = None, *, batch: int = 2, seq: int = 16,
                   seed: int = 0) -> torch.Tensor:
    """N(0, 1) hidden states of the call's shape, or (batch, seq, the block's width)."""
    gen = torch.Generator().manual_seed(seed)
    shape = hidden_states(call).shape if call else (batch, seq, _block_width(skeleton.get_submodule(block_path)))
    return torch.randn(shape, generator=gen, dtype=torch.float64)  # (B, T, C)


def _own_error(reference: list[torch.Tensor], original: nn.Module,
               run: Callable[[nn.Module, torch.dtype], list[torch.Tensor]], low_dtype: torch.dtype) -> float:
    """The original piece's own error in ``low_dtype``: ``original`` cast to it (in place, so no
    second copy is held; the float64 one is not used again) and ``run`` in it, against
    ``reference``, its float64 outputs, measured as every proof measures it
    (:func:`normfold.engine.verify.outputs_own_error`)."""
    low = run(original.to(low_dtype), low_dtype)
    return outputs_own_error([flatten_outputs(reference)], [flatten_outputs(low)], low_dtype, torch.float64)


def _judged(error: float, own: float, stored: torch.dtype) -> dict[str, Any]:
    """A piece's tolerance measured from its own error, the rule in words, and whether ``error`` is
    within it (a NaN error is not)."""
    tolerance, rule = measured_tolerance(own, stored)
    return {"own_error": own, "tolerance": tolerance, "tolerance_rule": rule, "ok": error <= tolerance}


def hidden_states(call: Call) -> torch.Tensor:
    args, kwargs = call
    return args[0] if args else kwargs["hidden_states"]


def call_block(block: nn.Module, call: Call | None, x: torch.Tensor):
    """``block`` on hidden states ``x`` with the rest of ``call``'s arguments."""
    with default_dtype_of(block):
        if call is None:
            return block(x)
        args, kwargs = call
        return block(x, *args[1:], **kwargs) if args else block(**{**kwargs, "hidden_states": x})


def check_shell(orig_dir: str | os.PathLike, folded_dir: str | os.PathLike, swapped: Sequence[SwappedNorm],
                stacks: dict[str, bool], *, stored_dtype: torch.dtype | None = None, seed: int = 0,
                trust_remote_code: bool = False, stream_map: StreamMap | None = None,
                extra_parameters: list[str] = (),
                shell_blocks: dict[str, int] | None = None) -> tuple[dict[str, Any], dict[str, Call]]:
    """Run the model cut to one block of each stack (``stacks``: path -> centered; the block
    ``shell_blocks[stack]``, default the first) from both folders in float64, one after the other,
    and compare every float output and, where each stack starts, the folded stream with
    P·(the original's) (centered) or the original's. A stack whose norm's γ/β the fold moved into
    the tail is cut to its last block: the tail then reads what it was folded for on both sides.

    This covers what no block check sees: the embeddings (and an embedding norm), the final norm
    and the head, tied or untied. The error is judged by the cut original's own error in
    ``stored_dtype`` (default: the folded checkpoint's) on the same inputs and quantities, as in
    :func:`check_block`. Returns the result (worst relative error, its tolerance, what was
    compared, the checkpoint keys the folded shell loaded under ``keys``) and, per stack, the
    arguments the original model called its first block with. ``stream_map``: the folded stream is
    that of the (centered) original's stream (a rotation: x·Q); ``extra_parameters``: parameters the
    folded folder holds and its class lacks (a created ``lm_head.bias``), given to the folded shell.
    """
    orig_dir, folded_dir = check_model_dir(orig_dir), check_model_dir(folded_dir)
    stored = stored_dtype or DTYPES[stored_dtype_name(folded_dir)]
    model, _ = _load_shell(orig_dir, [], list(stacks), trust_remote_code, shell_blocks=shell_blocks)
    inputs = example_inputs_for(model, seed=seed)
    ref, ref_calls = _run_shell(model, list(stacks), inputs)
    ref_seen = _shell_quantities(ref, ref_calls, stacks, stream_map)
    own = _own_error(ref_seen, model, lambda m, dt: _shell_quantities(*_run_shell(m, list(stacks), cast_floats(inputs, dt)),
                                                                       stacks, stream_map), stored)
    del model
    model, keys = _load_shell(folded_dir, swapped, list(stacks), trust_remote_code, extra_parameters, normfold_only=True,
                              shell_blocks=shell_blocks)
    out, calls = _run_shell(model, list(stacks), inputs)
    del model
    problems = []
    if not ref or len(ref) != len(out) or any(a.shape != b.shape for a, b in zip(ref, out)):
        problems.append(f"the model cut to one block per stack gave {len(ref)} float outputs, the folded one {len(out)} "
                        "(expected the same number and shapes, at least one)")
    problems += [f"the stream entering {stack} was not seen (its first block was never called)"
                 for stack in stacks if stack not in ref_calls or stack not in calls]
    folded_seen = _shell_quantities(out, calls, {stack: False for stack in stacks} if stream_map else stacks)
    errors = [] if problems else [output_error(a, b).error for a, b in zip(ref_seen, folded_seen)]
    error = max(errors, default=math.nan)
    cut = "model cut to its last block" if any((shell_blocks or {}).values()) else "model cut to its first block"
    result = {"block": cut if stacks else "model", "max_rel_error": error,
              **_judged(error, own, stored), "outputs": len(out), "stack_entries": len(stacks), "problems": problems,
              "keys": sorted(keys)}
    return result, ref_calls


def runs_in_float32(orig_dir: Path, stacks: list[str], trust_remote_code: bool = False) -> bool:
    """Whether the original cut to one block per stack runs in float32: when it fails in float64 only,
    float64 is what it cannot run in (XGLM fills a float64 tensor from a float32 default dtype)."""
    try:
        model, _ = _load_shell(orig_dir, [], stacks, trust_remote_code)
        _run_shell(model.float(), stacks, example_inputs_for(model))
    except Exception:  # noqa: BLE001  any failure of the model's own code: it fails in float32 too
        return False
    return True


def _shell_quantities(outputs: list[torch.Tensor], calls: dict[str, Call], stacks: dict[str, bool],
                      stream_map: StreamMap | None = None) -> list[torch.Tensor]:
    """What the shell check compares: the float outputs, then the stream entering each stack seen,
    centered (P·x) for a centered stack, then through ``stream_map``. Computed in float64."""
    entries = [hidden_states(calls[stack]).double() for stack in stacks if stack in calls]
    centered = [stacks[stack] for stack in stacks if stack in calls]
    return [t.double() for t in outputs] + [folded_stream(c, stream_map)(h) for h, c in zip(entries, centered)]




def _load_shell(folder: Path, swapped: Sequence[SwappedNorm], stacks: list[str],
                trust_remote_code: bool, extra_parameters: list[str] = (),
                normfold_only: bool = False, shell_blocks: dict[str, int] | None = None) -> tuple[nn.Module, set[str]]:
    """``folder``'s model with ``num_hidden_layers`` = 1 (0 without ``stacks``) in float64, its
    tensors loaded from the checkpoint (the ``extra_parameters`` its class lacks registered where
    their module is in the shell) and the RMSNorms swapped in; and the keys loaded. The one block
    of a stack holds the tensors and norms of its block ``shell_blocks[stack]`` (default 0)."""
    shell_blocks = shell_blocks or {}
    config = load_config(folder, trust_remote_code=trust_remote_code, normfold_only=normfold_only)
    config.num_hidden_layers = 1 if stacks else 0
    cls = model_class_for(config, trust_remote_code=trust_remote_code)
    model = cls._from_config(config, attn_implementation="eager", dtype=torch.float64).eval()
    checkpoint = Checkpoint(folder)
    stored = StoredKeys(model, checkpoint)
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    state, keys = {}, set()
    for name in model.state_dict():
        key = stored.key(_stored_path(name, shell_blocks))
        if key is None and name in params:
            raise CheckpointError(f"{folder} has no tensor for {name}")
        if key is not None:
            state[name] = checkpoint.read(key).double()
            keys.add(key)
    model.load_state_dict(state, strict=False)
    for name in extra_parameters:
        path, key = _shell_path(name, shell_blocks), stored.own_key(name)
        if path is None:  # of a block the shell does not hold
            continue
        if key is None:
            raise CheckpointError(f"{folder} has no tensor for {name}, which its report lists")
        owner_path, _, attr = path.rpartition(".")
        with contextlib.suppress(AttributeError):  # a module of a block the shell does not hold
            owner = model.get_submodule(owner_path)
            owner.register_parameter(attr, nn.Parameter(checkpoint.read(key).double(), requires_grad=False))
            keys.add(key)
    for entry in swapped:
        path = _shell_path(entry.path, shell_blocks)
        with contextlib.suppress(AttributeError):  # norms of blocks the shell does not hold
            if path is not None:
                swap_in_rmsnorm(model, replace(entry, path=path))
    return model, keys


def _shell_path(path: str, shell_blocks: dict[str, int]) -> str | None:
    """Where ``path`` lies in the model cut to block ``shell_blocks[stack]`` of each stack listed:
    that block's paths move to block 0, other blocks' are not there (None)."""
    for stack, i in shell_blocks.items():
        if path.startswith(stack + "."):
            block = f"{stack}.{i}."
            return f"{stack}.0.{path[len(block):]}" if path.startswith(block) else None
    return path


def _stored_path(path: str, shell_blocks: dict[str, int]) -> str:
    """The checkpoint's name for ``path`` of the cut model: block 0 of a listed stack is its block ``shell_blocks[stack]``."""
    for stack, i in shell_blocks.items():
        if path.startswith(f"{stack}.0."):
            return f"{stack}.{i}.{path[len(stack) + 3:]}"
    return path


def _run_shell(model: nn.Module, stacks: list[str],
               inputs: dict[str, Any]) -> tuple[list[torch.Tensor], dict[str, Call]]:
    """The float outputs of the shell ``model`` on ``inputs``, and the arguments of each stack's first block."""
    calls: dict[str, Call] = {}
    handles = []
    for stack in stacks:
        def keep_call(module, args, kwargs, stack=stack):
            calls[stack] = (args, kwargs)
        with contextlib.suppress(AttributeError):
            handles.append(model.get_submodule(f"{stack}.0").register_forward_pre_hook(keep_call, with_kwargs=True))
    try:
        with torch.no_grad(), default_dtype_of(model):
            output = model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    leaves = torch.utils._pytree.tree_leaves(output.to_tuple() if hasattr(output, "to_tuple") else output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()], calls


def stacks_of(skeleton: nn.Module, swapped: Sequence[SwappedNorm],
              centered_fqns: list[str] | None = None) -> dict[str, tuple[int, bool]]:
    """Stack path -> (number of blocks, centered), for each outermost ModuleList holding a norm (a
    norm type, or a module the fold swapped: an RMSNorm written out as ops); centered when it holds a
    swapped norm and (``centered_fqns``: the plan's centered tensors, when given) one of its tensors is
    centered (a recognised RMSNorm swapped for normfold's centers nothing)."""
    swapped_paths = [entry.path for entry in swapped]
    stacks: dict[str, tuple[int, bool]] = {}
    for path, module in skeleton.named_modules():
        if not isinstance(module, NORM_TYPES) and path not in swapped_paths:
            continue
        parts = path.split(".")
        for i in range(1, len(parts)):
            stack = ".".join(parts[:i])
            if isinstance(skeleton.get_submodule(stack), nn.ModuleList):
                centered = any(p.startswith(stack + ".") for p in swapped_paths) and (
                    centered_fqns is None or any(fqn.startswith(stack + ".") for fqn in centered_fqns))
                stacks[stack] = (len(skeleton.get_submodule(stack)), centered)
                break
    return stacks


def compare_copies(orig: Checkpoint, folded: Checkpoint, keys: list[str]) -> list[str]:
    """The keys among ``keys`` whose folded tensor is not the original's cast to its saved dtype
    (one tensor in memory at a time); a key missing from either side counts as different."""
    differ = []
    for key in keys:
        if key not in orig.meta or key not in folded.meta:
            differ.append(key)
            continue
        value = folded.read(key)
        if not torch.equal(orig.read(key).to(value.dtype), value):
            differ.append(key)
    return differ


def _block_width(block: nn.Module) -> int:
    """The feature width of the stream a block reads: its first norm over the last dim's (a GroupNorm or
    BatchNorm normalises channels of another layout: no width of a (B, T, C) stream)."""
    for m in block.modules():
        if isinstance(m, NORM_TYPES) and hasattr(m, "normalized_shape"):
            return m.normalized_shape[-1]
    raise CheckpointError("cannot tell the block's width: it has no norm over its last dim")


def first_output(output) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output
