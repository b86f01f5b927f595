"""Between the captured submodules: which tensors pass from one captured call to the next, and what the
uncaptured code computes from them on the way.

When the whole model cannot be exported, the submodules that can are merged into one graph
(``submodules.py``); this module tells that merge how they connect. One eager run of the whole model
per call, under a ``TorchDispatchMode``, follows every tensor a captured call returns and every
parameter and buffer of the model. Each aten op the code between the captured calls applies to a
followed tensor is recorded as a glue op (``cls.expand`` + ``cat``, ``embeds + positions``) and its
results are followed in turn; a captured call's input that is a followed tensor, unchanged since
(the same object at the same version), is wired to it. What is not followed: tensors computed from
unfollowed tensors alone (inputs of unknown origin in the graph), a tensor after something writes
into it, a value read into Python (``if h.sum() > 0``: the branch it decides is no op of a graph),
and what a captured call reads of a followed tensor it was not given: those count as read elsewhere,
like what the root returns (their changes would be seen there).

The recording is of one input, and the graph it builds is an aid to the analysis, never a proof: the
fold is proved on the whole model, eagerly, on other inputs too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

# What a followed tensor is: ("call", order of the captured call, index of its output leaf),
# ("glue", index of the glue op in the run, index of its output leaf), or ("parameter" | "buffer", fqn).
Key = tuple


@dataclass(frozen=True)
class Followed:
    """An argument of a glue op that is a followed tensor."""

    key: Key
    value: torch.Tensor  # on the meta device: what a graph without that tensor's producer stands in for


@dataclass(frozen=True)
class Unknown:
    """An argument of a glue op computed from unfollowed tensors alone: its shape and dtype only."""

    value: torch.Tensor  # on the meta device


@dataclass
class GlueOp:
    """One aten op of the code between the captured calls, on at least one followed tensor."""

    func: Any           # the aten OpOverload
    args: tuple         # tensors as Followed / Unknown, everything else as the op received it
    kwargs: dict
    outputs: list       # the flat tensor outputs, on the meta device (None for a non-tensor leaf)
    single: bool        # the op returned one tensor (not a tuple or list of them)


@dataclass
class CallWiring:
    """What one eager run of one example call showed."""

    events: list = field(default_factory=list)  # in run order: the order of each captured call, or a GlueOp
    wired: dict[tuple[int, int], Key] = field(default_factory=dict)  # (order, input leaf) -> what it is
    read_elsewhere: set[Key] = field(default_factory=set)  # followed tensors read where no graph sees it


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


class Follower(TorchDispatchMode):
    """The dispatch mode of the wiring run (module docstring). ``enter``/``leave`` are called by the
    forward hooks of the captured calls; ``paused`` while the hooks themselves run torch ops."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.paused = False

    def start(self) -> CallWiring:
        """Begin one example call: the model's parameters and buffers are the only followed tensors."""
        self.wiring = CallWiring()
        self.followed: dict[int, tuple[torch.Tensor, Key, int]] = {}  # id -> (tensor, key, version)
        self.given: list[set[int]] = []  # per active captured call, the ids of its input tensors
        self.fresh: list[torch.Tensor] = []  # the last glue op's outputs, whose version is read at the next event
        for kind, named in (("parameter", self.model.named_parameters()), ("buffer", self.model.named_buffers())):
            for fqn, t in named:
                self._follow(t, (kind, fqn))
        return self.wiring

    def enter(self, order: int, inputs) -> None:
        self._settle()
        self.wiring.events.append(order)
        ids = set()
        for index, leaf in enumerate(pytree.tree_leaves(inputs)):
            if isinstance(leaf, torch.Tensor):
                ids.add(id(leaf))
                key = self._key(leaf)
                if key is not None and key[0] in ("call", "glue"):
                    self.wiring.wired[(order, index)] = key
        self.given.append(ids)

    def leave(self, order: int, output) -> None:
        self._settle()
        self.given.pop()
        for index, leaf in enumerate(pytree.tree_leaves(output)):
            if isinstance(leaf, torch.Tensor):
                self._follow(leaf, ("call", order, index))

    def returned(self, output) -> None:
        """The root's own output: every followed tensor in it is seen by the caller."""
        self._settle()
        for leaf in pytree.tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and (key := self._key(leaf)) is not None:
                self.wiring.read_elsewhere.add(key)

    def _follow(self, t: torch.Tensor, key: Key) -> None:
        self.followed[id(t)] = (t, key, t._version)

    def _settle(self) -> None:
        """Read the version of the last glue op's outputs now that the op has returned: a view made inside
        the dispatch gets its base's version counter only on the way out (nothing can write in between:
        a write is itself a dispatched op, and every event settles first)."""
        for t in self.fresh:
            if id(t) in self.followed and self.followed[id(t)][0] is t:
                self.followed[id(t)] = (t, self.followed[id(t)][1], t._version)
        self.fresh = []

    def _key(self, t: torch.Tensor) -> Key | None:
        """What ``t`` is, when followed and unchanged since; a followed tensor written since is marked
        read elsewhere (what it held is not what it holds) and no longer followed."""
        entry = self.followed.get(id(t))
        if entry is None or entry[0] is not t:
            return None
        if entry[2] != t._version:
            self.wiring.read_elsewhere.add(entry[1])
            del self.followed[id(t)]
            return None
        return entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._settle()
        out = func(*args, **kwargs)
        if self.paused:
            return out
        keys = {id(leaf): key for leaf in pytree.tree_leaves((args, kwargs))
                if isinstance(leaf, torch.Tensor) and (key := self._key(leaf)) is not None}
        produced = [k for k in keys.values() if k[0] in ("call", "glue")]
        if self.given:  # inside a captured call: its graph holds the op; reading another's output it was not given is not
            self.wiring.read_elsewhere.update(k for i, k in keys.items() if k[0] in ("call", "glue") and i not in self.given[-1])
            return out
        if not keys:
            return out
        if not any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(out)):
            # a value read into Python (``.item()``, ``if t.sum() > 0``): what it decides no graph shows
            self.wiring.read_elsewhere.update(produced)
            return out
        if func._schema.is_mutable:  # a write: what it wrote into is no longer what the graph would say
            self.wiring.read_elsewhere.update(produced)
            for leaf in pytree.tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor):
                    self.followed.pop(id(leaf), None)
            return out
        self._record(func, args, kwargs, keys, out)
        return out

    def _record(self, func, args, kwargs, keys: dict[int, Key], out) -> None:
        def as_argument(value):
            if not isinstance(value, torch.Tensor):
                return value
            return Followed(keys[id(value)], _on_meta(value)) if id(value) in keys else Unknown(_on_meta(value))

        index = sum(isinstance(e, GlueOp) for e in self.wiring.events)
        leaves = pytree.tree_leaves(out)
        op = GlueOp(func, pytree.tree_map(as_argument, args), pytree.tree_map(as_argument, kwargs),
                    [_on_meta(leaf) if isinstance(leaf, torch.Tensor) else None for leaf in leaves],
                    isinstance(out, torch.Tensor))
        self.wiring.events.append(op)
        for position, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                self._follow(leaf, ("glue", index, position))
                self.fresh.append(leaf)
