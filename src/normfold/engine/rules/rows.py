"""Ops that treat every feature alike: masked fills and scatters, where, index writes, gather, repeat, roll,
reductions over other dims, average pooling, upsampling and grid sampling.

Each op here moves, copies, averages or zeroes whole rows along the normalized dim, or permutes a
row's entries, with the same choice for every entry of the row (a mask or an index that is
constant along the dim, weights that do not depend on the channel). Such an op is linear in each
row and maps a row of ones to a row of ones (or to zeros), so it commutes with P: op(P·x) = P·op(x).
"""
from __future__ import annotations

import torch
from torch import fx

from ..graph import node_arg as _arg  # the short name reads better in the rules below
from ..graph import op_name, op_packet, trace_shape
from ..op_kinds import aten_packets, passes_values_on
from .answers import Break, Requires, collect, make_need, only_at, rank
from .elementwise import broadcast_dims, broadcast_operand, is_zero_literal
from .writes import written_in_place

_aten = torch.ops.aten

# upsampling and average pooling -> how many trailing (spatial) dims they act on
SPATIAL_OP_NAMES = {
    **dict.fromkeys(("upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_linear1d", "avg_pool1d",
                     "adaptive_avg_pool1d"), 1),
    **dict.fromkeys(("upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
                     "upsample_bicubic2d", "_upsample_bicubic2d_aa", "avg_pool2d", "adaptive_avg_pool2d",
                     "_adaptive_avg_pool2d"), 2),
    **dict.fromkeys(("upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_trilinear3d", "avg_pool3d",
                     "adaptive_avg_pool3d", "_adaptive_avg_pool3d"), 3)}
_SPATIAL_DIMS = {packet: k for name, k in SPATIAL_OP_NAMES.items() for packet in aten_packets(name)}
# ops whose output entry at p is their first input's at q, each q_k a function of p_k alone (right-aligned; new
# leading dims read no input dim): broadcasts (q_k = 0 or p_k), repeats (q_k = p_k mod n_k), slices (start + step·p_k)
_PER_DIM_COPY_OPS = set(aten_packets("expand", "expand_as", "broadcast_to", "repeat", "tile", "slice"))
# elementwise ops on masks and indices (comparisons, logic, arithmetic): constant along a dim where every
# operand is
_ELEMENTWISE_OPS = set(aten_packets("eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and", "logical_or",
                                    "logical_xor", "bitwise_not", "bitwise_and", "bitwise_or", "__and__", "__or__",
                                    "__invert__", "add", "sub", "mul", "div", "neg", "remainder", "floor_divide"))


def constant_along(value, out_rank: int, dim: int) -> bool:
    """``value`` (a number, or a tensor broadcast right-aligned to rank ``out_rank``) holds one entry all
    along ``dim``, for every input: proved from its producers, never from the example's values.

    - a number, or a dim of size 1 or absent (broadcast): one entry, whatever the values;
    - a tensor written in place (or through a view) anywhere: no, its readers may see other values;
    - a broadcast, repeat, tile or slice: its entry at p is the input's at q with each q_k a function
      of p_k alone, so along ``dim`` it reads the input along the same dim (or no input dim, for a
      new leading dim): constant where the input is;
    - a copy or cast: the input's values; ``unsqueeze``, ``select``, ``permute``, ``transpose``: the
      input's values with the dims renamed, constant where the input is along the dim it came from;
    - an elementwise comparison, logic or arithmetic op: a function of its operands' entries at the
      same position, constant where every operand is.

    Anything else is False."""
    if not isinstance(value, fx.Node):
        return isinstance(value, (int, float, bool))
    s = trace_shape(value)
    if s is None:
        return False
    d = dim - (out_rank - len(s))
    if d < 0 or s[d] == 1:
        return True
    if written_in_place(value) is not None:
        return False
    packet, x = op_packet(value), value.args[0] if value.args else None
    if packet in _PER_DIM_COPY_OPS or passes_values_on(value, casts=True):
        return constant_along(x, len(s), d)
    if packet == _aten.unsqueeze:  # the new dim has size 1 (caught above); the others are the input's
        new = value.args[1] % len(s)
        return constant_along(x, len(s) - 1, d - (d > new))
    if packet == _aten.select:  # the selected dim is gone; the others are the input's
        gone = value.args[1] % (len(s) + 1)
        return constant_along(x, len(s) + 1, d + (d >= gone))
    if packet == _aten.permute:
        return constant_along(x, len(s), value.args[1][d] % len(s))
    if packet == _aten.transpose:
        a, b = value.args[1] % len(s), value.args[2] % len(s)
        return constant_along(x, len(s), b if d == a else a if d == b else d)
    if packet in _ELEMENTWISE_OPS:  # eq(ids, k), ~mask, a & b, ids + offset: constant where every operand is
        return all(constant_along(a, len(s), d) for a in value.args)
    return False


def _mask_varies(node, mask, dim) -> Break | None:
    if constant_along(mask, rank(node), dim):
        return None
    return Break(f"{op_name(node)} with a mask that varies along the normalized dim: it writes part of a row")


def zero_mean_masked_fill(node, dim, group):
    """Rows of x or rows of zeros, chosen by a mask constant along the dim: P(0) = 0. A non-zero fill
    value is a constant row (not zero-mean); a mask that varies along the dim fills part of a row."""
    x, mask, value = node.args[0], node.args[1], _arg(node, 2, "value")
    if not is_zero_literal(value):
        return Break(f"{op_name(node)} fills with {value.name if isinstance(value, fx.Node) else value!r}, "
                     "not 0: a filled row is constant, not zero-mean")
    return _mask_varies(node, mask, dim) or collect(node, [broadcast_operand(node, x, dim, group)])


def zero_mean_masked_scatter(node, dim, group):
    """Rows of x, or the next rows of source where a whole-row mask is set (image features merged into
    text embeddings). Source entries are taken in row-major order, so along the last dim a selected
    row is a whole row of source when source's rows have the same length."""
    x, mask, source = node.args[0], node.args[1], _arg(node, 2, "source")
    if trace_shape(source) is None:
        return Break(f"{op_name(node)}: source {source.name} is not a tensor")
    if dim != rank(node) - 1:
        return Break(f"{op_name(node)} along a dim other than the last: its source is read in row-major order")
    if trace_shape(source)[-1] != trace_shape(node)[-1]:
        return Break(f"{op_name(node)}: source rows of {trace_shape(source)[-1]} entries do not fill whole rows of "
                     f"{trace_shape(node)[-1]}")
    return _mask_varies(node, mask, dim) or collect(
        node, [broadcast_operand(node, x, dim, group), make_need(source, rank(source) - 1, group)])


def zero_mean_where(node, dim, group):
    """Rows of x or rows of y, chosen by a condition constant along the dim (each may be a literal 0,
    as in ``where(mask, x, 0)``): every output row is one input's row, and P acts row by row, so
    where(c, P·x, P·y) = P·where(c, x, y). The rows chosen are masked_fill's (where(c, 0, x) is
    masked_fill(x, c, 0)); a condition that varies along the dim mixes two rows' entries, and a
    non-zero number is a constant row (not zero-mean)."""
    if len(node.args) < 3:  # where(condition): the indices of its true entries, not a choice of rows
        return Break(f"{op_name(node)} with one argument returns indices, not rows")
    condition, x, y = node.args[0], node.args[1], node.args[2]
    number = next((v for v in (x, y) if not isinstance(v, fx.Node) and not is_zero_literal(v)), None)
    if number is not None:
        return Break(f"{op_name(node)} picks the number {number!r}, not 0, for some rows: a constant row, not zero-mean")
    return _mask_varies(node, condition, dim) or collect(
        node, [broadcast_operand(node, x, dim, group), broadcast_operand(node, y, dim, group)])


def shift_masked(node, operand, dims):
    """x + δ where the mask keeps x, the fill (or source) elsewhere: constant where δ and the mask are."""
    if not only_at(node, operand, 0):
        return None
    return _shift_where_rows_chosen(node, node.args[1], dims)


def shift_where(node, operand, dims):
    """where(c, x + δ, y) = where(c, x, y) + where(c, δ, 0) (likewise for y): constant where δ and the
    condition are (each row a row of δ or of zeros). Not through the condition, nor an operand that
    is both branches."""
    if len(node.args) < 3 or node.args[0] is operand or not (only_at(node, operand, 1) or only_at(node, operand, 2)):
        return None
    return _shift_where_rows_chosen(node, node.args[0], broadcast_dims(node, operand, dims))


def _shift_where_rows_chosen(node, mask, dims):
    """The output dims among ``dims`` along which ``mask`` is constant: there a shift δ of the chosen
    rows comes out as a row of δ or a row of zeros, constant either way."""
    return {d for d in dims if constant_along(mask, rank(node), d)}


def zero_mean_index_put(node, dim, group):
    """x with rows written (or, accumulating, added) at indices of the leading dims: each row is x's,
    values', or a sum of them; values broadcast right-aligned, so their last dim is the row. Writing
    along the last dim itself writes part of a row, unless it writes 0 under a bool mask constant along
    it: that is masked_fill(x, mask, 0), every row x's or zeros."""
    x, indices, values = node.args[0], list(node.args[1]), _arg(node, 2, "values")
    if any(index is not None and trace_shape(index) is None for index in indices):
        return Break(f"{op_name(node)}: an index is not a tensor")
    if _zeroes_whole_rows(node, indices, values, dim):  # x[mask] = 0, mask constant along the dim: masked_fill
        return collect(node, [make_need(x, dim, group)])
    if dim != rank(node) - 1 or _indexes_last_dim(indices, rank(x)):
        return Break(f"{op_name(node)} writes along the normalized dim (only writes of whole rows of the last dim keep "
                     "rows zero-mean)")
    return collect(node, [make_need(x, dim, group), broadcast_operand(node, values, dim, group)])


def _zeroes_whole_rows(node, indices: list, values, dim: int) -> bool:
    """``x[mask] = 0`` with a bool mask over all of x's dims that is constant along ``dim`` (Wav2Vec2-Conformer's
    ``hidden_states[~mask.unsqueeze(-1).repeat(1, 1, C)] = 0``): masked_fill(x, mask, 0), each row x's or zeros."""
    if node.kwargs.get("accumulate", node.args[3] if len(node.args) > 3 else False) or len(indices) != 1:
        return False
    mask = indices[0]
    return (mask is not None and mask.meta["val"].dtype == torch.bool and rank(mask) == rank(node)
            and is_zero_literal(values) and constant_along(mask, rank(node), dim))


def _indexes_last_dim(indices: list, n_dims: int) -> bool:
    """An index list (None: a whole dim; a bool mask covers as many dims as it has) reaches the last dim."""
    position = 0
    for index in indices:
        width = rank(index) if index is not None and index.meta["val"].dtype == torch.bool else 1
        if index is not None and position + width >= n_dims:
            return True
        position += width
    return False


def zero_mean_index_copy(node, dim, group):
    """Slices of x replaced by slices of source along another dim: each row is x's or source's."""
    x, d, source = node.args[0], node.args[1] % rank(node), _arg(node, 3, "source")
    if d == dim:
        return Break(f"{op_name(node)} copies entries along the normalized dim: it writes part of a row")
    return Requires((make_need(x, dim, group), make_need(source, dim, group)))


def zero_mean_gather(node, dim, group):
    """out[..., i, ..., k] = x[..., index[..., i, ..., k], ..., k] along another dim d. When the index
    is constant along the normalized dim (:func:`constant_along`: proved from its producers, as
    ViT-MAE's ``gather(x, 1, ids.unsqueeze(-1).repeat(1, 1, C))``) and as long as x's rows, every
    output row is one whole row of x (the row at position index[..., i, ..., 0] along d), so gather
    moves rows and commutes with P row by row: gather(P·x) = P·gather(x), per group too. An index
    that may vary along the dim mixes entries of different rows; a shorter one keeps part of a row."""
    x, d, index = node.args[0], node.args[1] % rank(node), node.args[2]
    if d == dim:
        return Break(f"{op_name(node)} picks entries along the normalized dim")
    if trace_shape(index) is None:
        return Break(f"{op_name(node)}: index {index.name} is not a tensor")
    if trace_shape(index)[dim] != trace_shape(x)[dim]:
        return Break(f"{op_name(node)} keeps {trace_shape(index)[dim]} of the {trace_shape(x)[dim]} entries of each row")
    if not constant_along(index, rank(node), dim):
        return Break(f"{op_name(node)} with an index that varies along the normalized dim: a row mixes entries "
                     "of different rows")
    return Requires((make_need(x, dim, group),))


def shift_gather(node, operand, dims):
    """gather is linear in x: gather(x + δ) = gather(x) + gather(δ), where gather(δ) at p is δ at p with
    its coordinate along d replaced by index[p]. Along an output dim e ≠ d it is constant where δ is
    constant along e and the coordinate read along d stays put as p_e moves (the index is constant
    along e) or does not matter (δ is constant along d too). Along d itself it is constant where δ is,
    or where the index is (every p_d then reads the same entry). Not through the index."""
    if not only_at(node, operand, 0):
        return None
    d, index, r = node.args[1] % rank(node), node.args[2], rank(node)
    out = {e for e in dims if d in dims or constant_along(index, r, e)}
    return out | {d} if constant_along(index, r, d) else out


def _repeat_counts(node) -> list[int]:
    """One count per output dim: ``repeat`` gives them all; ``tile`` pads missing leading ones with 1."""
    counts = list(node.args[1])
    return [1] * (rank(node) - len(counts)) + counts


def zero_mean_repeat(node, dim, group):
    """Copies of x side by side (``repeat``, ``tile``). Along another dim a row is a row of x. Along
    the dim itself a row is [r, r, …, r] for a row r of x, whose mean is r's: centering x centers it
    (per group when the groups do not straddle the copies). A new leading dim, or a dim of size 1
    repeated, makes a constant row: not zero-mean."""
    x = node.args[0]
    new = rank(node) - rank(x)
    if dim < new:
        return Break(f"{op_name(node)} copies the tensor along a new normalized dim: a constant row")
    n, count = trace_shape(x)[dim - new], _repeat_counts(node)[dim]
    if count != 1 and n == 1:
        return Break(f"{op_name(node)} fills the normalized dim from a single entry: a constant row")
    if count != 1 and group is not None and n % group and group % n:
        return Break(f"{op_name(node)}: groups of {group} straddle the {count} copies of {n} entries")
    return Requires((make_need(x, dim - new, None if group is not None and group % n == 0 else group),))


def shift_repeat(node, operand, dims):
    """Copies of a constant run are constant, along the repeated dims too; new leading dims hold copies."""
    if not only_at(node, operand, 0):
        return None
    new = rank(node) - rank(operand)
    return {d + new for d in dims} | set(range(new))


def zero_mean_roll(node, dim, group):
    """A cyclic shift along some dims: along other dims it moves whole rows; along the dim it permutes
    each row's entries, which keeps its mean (a group's, when the shift moves whole groups). With no
    dims it rolls the flattened tensor, moving entries between rows."""
    shifts, dims = node.args[1], _arg(node, 2, "dims", [])
    shifts, dims = [shifts] if isinstance(shifts, int) else list(shifts), [dims] if isinstance(dims, int) else list(dims)
    if not dims:
        return Break(f"{op_name(node)} of the flattened tensor moves entries between rows")
    for amount, d in zip(shifts, dims):
        if d % rank(node) == dim and group is not None and amount % group:
            return Break(f"{op_name(node)} by {amount} along the normalized dim mixes its groups of {group}")
    return Requires((make_need(node.args[0], dim, group),))


def shift_roll(node, operand, dims):
    """A cyclic shift along some dims moves a constant run along them, still constant."""
    return dims if only_at(node, operand, 0) and _arg(node, 2, "dims", []) else None


def zero_mean_unfold(node, dim, group):
    """Sliding windows along dim d (``x.unfold(d, k, s)``: (…, n, …, k), out[…, i, …, j] = x[…, i·s + j, …],
    the window offset j a new last dim; Granite Speech 5's block attention): along any other dim e < r the
    entries sit where they were in x, whole rows copied, so P along e commutes; along the windows (d) or
    within them (the new dim) each output row takes entries from several rows of x: Break."""
    x, d = node.args[0], node.args[1] % rank(node.args[0])
    if dim in (d, rank(node) - 1):
        return Break(f"{op_name(node)} along its window dim: each window takes entries of several rows")
    return Requires((make_need(x, dim, group),))


def shift_unfold(node, operand, dims):
    """A shift constant along dims of x stays constant along them (the entries keep their place), and along
    the windows and within them too where it is constant along the unfolded dim."""
    if not only_at(node, operand, 0):
        return None
    d = node.args[1] % rank(operand)
    return {e for e in dims if e != d} | ({d, rank(node) - 1} if d in dims else set())


def zero_mean_reduce_other_dims(node, dim, group):
    x = node.args[0]
    dims = _arg(node, 1, "dim", None)
    if dims is None:
        return Break(f"{op_name(node)} over all dims")
    r_in = rank(x)
    reduced = sorted({d % r_in for d in ([dims] if isinstance(dims, int) else dims)})
    keep = _arg(node, 2, "keepdim", False)
    src = dim if keep else [d for d in range(r_in) if d not in reduced][dim]
    if src in reduced:
        return Break(f"{op_name(node)} reduces the normalized dim")
    return Requires((make_need(x, src, group),))


def shift_reduce(node, operand, dims):
    """Summing (averaging) over other dims: Σ δ is constant where δ was."""
    reduce = _arg(node, 1, "dim", None)
    if reduce is None or not only_at(node, operand, 0):
        return None
    reduced = {d % rank(operand) for d in ([reduce] if isinstance(reduce, int) else reduce)}
    if _arg(node, 2, "keepdim", False):
        return dims - reduced
    return {d - sum(r < d for r in reduced) for d in dims - reduced}


def zero_mean_spatial(node, dim, group):
    """Upsampling and average pooling over the trailing spatial dims: out[n, c] = A·x[n, c] with the
    same weights A for every channel (and batch entry), so centering over channels commutes with it.
    Along a spatial dim the op mixes the entries of a row."""
    if dim >= rank(node) - _SPATIAL_DIMS[op_packet(node)]:
        return Break(f"{op_name(node)} mixes entries along the normalized dim (a spatial dim)")
    return Requires((make_need(node.args[0], dim, group),))


def shift_spatial(node, operand, dims):
    """The same weights for every channel: constant along the non-spatial dims where δ is (along a spatial
    dim, padded pooling weights need not sum to 1)."""
    if not only_at(node, operand, 0):
        return None
    return {d for d in dims if d < rank(node) - _SPATIAL_DIMS[op_packet(node)]}


GRID_SAMPLER_OP_NAMES = ("grid_sampler", "grid_sampler_2d", "grid_sampler_3d")


def zero_mean_grid_sample(node, dim, group):
    """Sampling x (N, C, *space) at grid points: out[n, c, p] = Σ_q w_n(p, q)·x[n, c, q] for every mode
    (nearest, bilinear, bicubic) and padding (zeros, border, reflection), with weights from the grid
    alone: the same for every channel, so centering over channels (dim 1) commutes with it (position
    tables resized to an image's grid, as in GLM-Image). The weights differ per batch entry and mix
    space, so along any other dim the op mixes the entries of a row."""
    if dim != 1:
        return Break(f"{op_name(node)} mixes entries along the normalized dim (its weights vary along every dim "
                     "but the channels)")
    return Requires((make_need(node.args[0], dim, group),))


def shift_grid_sample(node, operand, dims):
    """The same weights for every channel: a shift constant along the channels stays so; along the
    batch dim the grid (hence the weights) may differ, and zero padding need not keep a constant."""
    if not only_at(node, operand, 0):
        return None
    return {d for d in dims if d == 1}
