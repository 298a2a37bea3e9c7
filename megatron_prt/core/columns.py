"""One rank's actions held as three columns: stages, ops, micro-batches.

[Note: columnar ranks]
A plan of P=64, R=8, m=512 holds half a million compute actions, its lowering a million
and a half. Made as :class:`~megatron_prt.core.actions.Action` values they are most of what
planning costs at that scale: each is a tuple to allocate, and every pass that reads the
plan (the flat check, lowering) takes each one apart again into its stage, op and
micro-batch. The planner's own producers (the list scheduler, :func:`~megatron_prt.core.
lower.lower`) therefore hand a rank over as :class:`RankActions`: the three columns, with the
``Action`` values made only when something asks for them, once, and kept. To everything
else it reads as the rank's tuple of actions: indexing and slicing (slices are tuples),
iteration, ``len``, ``in``, ``index``, ``count``, ``+`` with a tuple, equality and hash with
that tuple, copying and pickling. It is not a ``tuple`` (``isinstance``), and does not
repeat (``*``), order (``<``, ``sorted`` of ranks) or go into ``json.dumps`` as one:
``tuple(rank)`` does all of that. The passes that know it read :func:`columns` instead, which
takes the columns of any rank, a plain tuple included, so a plan read from a file is
checked the same way. The columns are read-only, like the tuple they stand for: the
planner's are tuples, and a :class:`RankActions` keeps the sequences it is given, so a caller
that hands it lists must not change them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain, repeat
from operator import itemgetter

from .actions import Action, Op

_STAGE, _OP, _MB = itemgetter(0), itemgetter(1), itemgetter(2)
Columns = tuple[Sequence[int], Sequence[Op], Sequence[int]]


class RankActions(Sequence):
    """One rank's ordered actions as ``stages[i], ops[i], mbs[i]`` (equal lengths); the
    tuple of :class:`Action` values is made on first use (see [Note: columnar ranks])."""

    __slots__ = ("_actions", "mbs", "ops", "stages")

    def __init__(self, stages: Sequence[int], ops: Sequence[Op], mbs: Sequence[int]) -> None:
        if not len(stages) == len(ops) == len(mbs):
            raise ValueError(
                f"RankActions: columns of unequal length (stages {len(stages)}, ops "
                f"{len(ops)}, mbs {len(mbs)})"
            )
        self.stages, self.ops, self.mbs = stages, ops, mbs
        self._actions: tuple[Action, ...] | None = None

    @property
    def actions(self) -> tuple[Action, ...]:
        """The rank's actions as a tuple (made once, then kept)."""
        if self._actions is None:
            rows = zip(self.stages, self.ops, self.mbs, strict=True)
            self._actions = tuple(map(tuple.__new__, repeat(Action), rows))  # Action._make
        return self._actions

    def __len__(self) -> int:
        return len(self.stages)

    def __getitem__(self, index):
        return self.actions[index]

    def __iter__(self) -> Iterator[Action]:
        return iter(self.actions)

    def __reversed__(self) -> Iterator[Action]:
        return reversed(self.actions)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RankActions):
            other = other.actions
        return self.actions == other if isinstance(other, tuple) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.actions)

    def __add__(self, other: object):
        return self.actions + (other.actions if isinstance(other, RankActions) else other)

    def __radd__(self, other: object):
        return other + self.actions

    def __repr__(self) -> str:
        return repr(self.actions)

    def __reduce__(self):
        return RankActions, (self.stages, self.ops, self.mbs)


def columns(actions: Sequence[Action]) -> Columns:
    """``(stages, ops, mbs)`` of one rank's actions: a :class:`RankActions`' own columns
    (shared, read-only), else taken apart now."""
    if isinstance(actions, RankActions):
        return actions.stages, actions.ops, actions.mbs
    return (
        list(map(_STAGE, actions)),
        list(map(_OP, actions)),
        list(map(_MB, actions)),
    )


def ops_of(actions: Sequence[Action]) -> Sequence[Op]:
    """The ops of one rank's actions (a :class:`RankActions`' own column, shared)."""
    if isinstance(actions, RankActions):
        return actions.ops
    return list(map(_OP, actions))


def picker(indices: Sequence[int]) -> Callable[[Sequence], tuple]:
    """``pick(seq)``: the items of ``seq`` at ``indices``, in that order, as a tuple (one
    C-level ``itemgetter`` call; unlike ``itemgetter``, a single index gives a 1-tuple)."""
    if len(indices) == 1:
        only = indices[0]
        return lambda seq: (seq[only],)
    return itemgetter(*indices) if indices else lambda seq: ()


def join(per_rank: Iterable[Columns]) -> tuple[list[int], list[Op], list[int]]:
    """The columns of every rank (:func:`columns` of each), rank after rank: three lists as
    long as the plan."""
    per_rank = list(per_rank)
    return tuple(list(chain.from_iterable(map(itemgetter(k), per_rank))) for k in range(3))
