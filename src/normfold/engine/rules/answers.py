"""The question every rule answers, its three answers, and the readings of a node all rules share.

A rule is asked ``Need(node, dim, group)`` (is ``node`` zero-mean along ``dim``, within groups of
``group`` elements, for every input?) and answers ``Requires`` (yes, iff each listed Need holds),
``Source`` (a leaf that is, or can be made, zero-mean) or ``Break`` (no, and why). The module
docstring of :mod:`normfold.engine.rules` says why every answer is exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from torch import fx

from ..graph import trace_shape


class Need(NamedTuple):
    """A question: is ``node`` zero-mean along ``dim`` (per ``group`` elements, None = whole dim)?

    ``dim`` may also be a sorted tuple of dims, with group None: zero-mean jointly over that block
    (features split and permuted by layout ops, e.g. (H, D) → (D, H) before a merge back to C).
    Only layout rules (and scaling by a number) accept blocks; every other op breaks on them.
    ``part``: only a part of ``node`` must be (``Part``, asked by ``classify_part``; None: all of it).
    """

    node: fx.Node
    dim: int | tuple[int, ...]
    group: int | None
    part: Part | None = None


class Part(NamedTuple):
    """The part of a node a Need asks about: along the need's own dim, only the groups (of the
    need's ``group`` elements) numbered in ``groups`` (None: every group); along other dims, only
    the indices in ``where`` ((dim, indices) pairs, sorted by dim)."""

    groups: frozenset[int] | None
    where: tuple[tuple[int, frozenset[int]], ...]


@dataclass(frozen=True)
class Requires:
    needs: tuple[Need, ...]


@dataclass(frozen=True)
class Source:
    kind: str               # "parameter" (centerable), "zero" (literal zeros, a − a, 0·y), "normalized" (weightless LN output)
    fqn: str | None = None  # the parameter's FQN for kind == "parameter"


@dataclass(frozen=True)
class Break:
    reason: str


Answer = Requires | Source | Break


def make_need(node: fx.Node, dim, group: int | None) -> Need:
    """Canonical Need: a group that spans the whole dim is written None; a block of one dim is that dim."""
    if isinstance(dim, tuple):
        dim = tuple(sorted(dim))
        if len(dim) == 1:
            dim = dim[0]
    s = trace_shape(node)
    if s is not None and group is not None and not isinstance(dim, tuple) and group == s[dim]:
        group = None
    return Need(node, dim, group)


def part_need(node: fx.Node, dim: int, group: int | None, groups, where) -> Need:
    """A canonical Need for a part: no Part when it covers the whole node."""
    need = make_need(node, dim, group)
    n_groups = trace_shape(node)[dim] // (need.group or trace_shape(node)[dim])
    groups = None if groups is None or set(groups) >= set(range(n_groups)) else frozenset(groups)
    where = tuple(sorted((d, frozenset(s)) for d, s in dict(where).items()
                         if not set(s) >= set(range(trace_shape(node)[d]))))
    return need if groups is None and not where else need._replace(part=Part(groups, where))


def collect(node: fx.Node, parts) -> Answer:
    """Requires(all Needs in parts) unless one of them is a Break."""
    needs = []
    for part in parts:
        if isinstance(part, Break):
            return part
        if part is not None:
            needs.append(part)
    return Requires(tuple(needs))


def rank(node: fx.Node) -> int:
    """The number of dims of ``node``'s output."""
    return len(trace_shape(node))


def only_at(node: fx.Node, operand: fx.Node, index: int) -> bool:
    """``operand`` is argument ``index`` of ``node`` and no other argument."""
    args = list(node.args) + list(node.kwargs.values())
    return len(node.args) > index and node.args[index] is operand and sum(a is operand for a in args) == 1
