"""Repeating the list scheduler's steady state instead of scheduling it action by action.

[Note: repeating the steady state]
:func:`megatron_prt.core.greedy._steps` is deterministic: what it does from an instant on
depends only on its state then. :class:`SteadyWatch` looks at that state each time the next
micro-batch of pipeline 0 enters (its first forward starts); when the state equals one seen
earlier shifted by ``d`` micro-batch rounds (``d * pipelines`` micro-batches, ids ``+ d *
kw``) and ``dt`` ticks, the actions started in between (the *period*) are repeated, shifted,
as many times ``K`` as the argument below allows, the state is moved on by ``K`` periods,
and the scheduler goes on from there. The plan is the one the scheduler would have made.

Used only when messages are free (``p2p == 0``), no action takes zero time, the policy is
not ``flush``, micro-batches take the pipelines in turn and both sort keys rise strictly
with the micro-batch. Then:

* Every kind (stage, op) starts its micro-batches in order (induction over starts: if
  ``(kind, mb + 1)`` starts while ``(kind, mb)`` has not, ``mb`` is not ready, or the heap
  would pop it first (same stage part, lower mb part); so a producer of ``mb`` is not done
  while its ``mb + 1`` is, impossible on one rank running in order). So the state at the end
  of an instant is: per kind the count started; per rank the running action and its end,
  the activations held, whether it last ran a backward. Done = started less running (no
  zero-time action is left to finish), ready = its one producer done ([Note: implied
  producers] in :mod:`megatron_prt.core.graph`): the heaps follow. That is the watched
  state, relative to the count of pipeline 0's first stage.
* Shifted by ``d * kw`` ids, every comparison the heaps make gives the same answer when the
  keys' micro-batch parts move by a constant (checked over every micro-batch); so from a
  repeated state each choice is the period's choice shifted, as long as the shifted action
  exists (``K`` bounds the largest id of the period and of the running actions below
  ``n``). A shifted heap lacks the images past the last micro-batch; its minimum is still
  the image of the original minimum while that image exists.
* Each start checks ``now <= room[rank]`` (the give-up bound, :class:`~megatron_prt.core.
  greedy.Run`; the scheduler keeps it as the idle time left past the end of the rank's
  last action, and checks only starts after idle time, the others keeping it); over a
  period ``room`` grows by the rank's work ``W``, ``now`` by ``dt >= W``, so the slack of
  each start shrinks by ``dt - W`` per period: ``K`` keeps every repeated slack at or
  above 0. A period with a forced forward or a give-up is not repeated.
* After the ``K`` repeats, the period's first part, up to a later sample within it, is
  copied once more (shifted ``K + 1`` periods) when the same two bounds hold for its starts
  and for the actions running at that sample; the state then is that sample's, shifted
  ``K + 1`` periods, its heaps rebuilt from the counts as above. The whole periods alone
  left up to a period less one sample to list-schedule before the cool-down.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from heapq import heapify
from itertools import accumulate, chain, repeat
from operator import add, lt, mod, sub


class SteadyWatch:
    """The watch of one scheduling run (see [Note: repeating the steady state]). The
    scheduler calls :meth:`sample` at the end of each instant in which the first forward of
    micro-batch ``next_source`` started (pipeline 0's micro-batches in turn); ``rank`` runs
    those forwards. ``next_source`` is -2 once the watch is over."""

    @classmethod
    def of(cls, graph, ticks, hop: int, flush: bool, keys) -> SteadyWatch | None:
        """A watch when the conditions of the note hold (``ticks``: the integer stage times
        scheduled with), else None."""
        pipes = graph.placement.num_pipelines
        turns = tuple(mb % pipes for mb in range(len(graph.mb_pipeline)))
        rising = all(all(map(lt, key.by_mb, key.by_mb[1:])) for key in keys)
        if hop or flush or graph.mb_pipeline != turns or not rising:
            return None
        if min(graph.busy_per_kind(ticks), default=0) <= 0:
            return None
        return cls(graph, graph.durations(ticks), keys)

    def __init__(self, graph, duration: list[int], keys) -> None:
        self.n, self.duration, self.keys = graph.n, duration, keys
        self.pipes = graph.placement.num_pipelines
        self.kw = graph.width * self.pipes  # ids per round of micro-batches (one per pipeline)
        self.rank, self.next_source = graph.rank[0], 0
        self.seen: dict[tuple, tuple] = {}
        self.history: list[tuple] = []  # per sample: (now, base, started, state)
        self.rank_of = graph.rank[: self.kw]  # per offset in a round (id mod kw)
        steps = graph.consumer_steps[0][: self.kw]
        self.producer_of = [-1] * self.kw  # per offset: its one producer's offset (-1: none)
        for offset, step in enumerate(steps):
            if step:
                self.producer_of[offset + step] = offset

    def sample(self, now: int, interruptions: int, run: dict) -> tuple[int, int] | None:
        """Record the state; when it repeats, repeat the period in ``run`` (the scheduler's
        lists, changed in place) and return (ticks skipped, actions finished meanwhile).

        The per-rank part of the state is the key of what is kept; the counts started per
        kind are compared only when that part recurs: they moved by the same ``d`` for every
        kind exactly when the starts in between hold ``d`` of every kind."""
        self.next_source += self.kw
        base = self.next_source // self.kw  # rounds whose first forward has started
        shift = base * self.kw
        started, current = run["started"], run["current"]
        state = (
            tuple(None if c < 0 else c - shift for c in current),
            tuple(map(sub, run["end"], repeat(now))),
            tuple(run["last_bwd"]),
            tuple(run["held"]),
        )
        earlier = self.seen.get(state)
        self.seen[state] = (now, base, len(started), interruptions, len(self.history))
        self.history.append((now, base, len(started), state))
        if earlier is None:
            return None
        t0, base0, started0, interruptions0, index0 = earlier
        rounds = base - base0
        if interruptions != interruptions0 or not self._keys_shift(rounds):
            return None  # not a clean period: watch on from this state
        kinds = Counter(map(mod, started[started0:], repeat(self.kw)))
        if len(kinds) != self.kw or set(kinds.values()) != {rounds}:
            return None
        period = _Period(run, t0, started0, now - t0, rounds * self.kw, self.duration)
        times = min(self._room_bound(period, run), self._id_bound(period, run))
        if times < 1:
            return None
        self.next_source = -2  # one repeat per run: what follows is the cool-down
        prefix = self._prefix(period, times, run, self.history[index0 + 1 : -1])
        count = len(started)
        run["entries"].fill()  # the shifted heaps read entries past any started micro-batch
        period.repeat(times, run, self)
        if prefix is not None:
            return self._resume_at(prefix, period, times, run) - now, len(started) - count
        return times * period.ticks, times * len(period.started)

    def _keys_shift(self, rounds: int) -> bool:
        """Both keys' micro-batch parts move by one constant per ``rounds`` rounds."""
        mbs = rounds * self.pipes
        for key in self.keys:
            by_mb = list(key.by_mb)
            if len(set(map(sub, by_mb[mbs:], by_mb[: len(by_mb) - mbs]))) > 1:
                return False
        return True

    def _id_bound(self, period: _Period, run: dict) -> int:
        """How many repeats keep every started and running id below ``n``."""
        top = max(max(period.started), max(run["current"]))
        return (self.n - 1 - top) // period.ids

    def _room_bound(self, period: _Period, run: dict) -> int:
        """How many repeats keep every start within the give-up bound (no give-up in the
        period: ``room`` then grew by the period's work alone; none without a limit)."""
        times = self.n  # more than any run repeats
        if run["room"] is None:
            return times
        for rank, (ids, begins) in enumerate(zip(period.order, period.begins, strict=True)):
            work = period.work[rank]
            if not ids or work >= period.ticks:
                continue
            room0 = run["room"][rank] - work
            room = accumulate(map(self.duration.__getitem__, ids), initial=room0)
            slack = min(map(sub, room, begins))
            times = min(times, slack // (period.ticks - work))
        return times

    def _prefix(self, period: _Period, times: int, run: dict, samples: list) -> tuple | None:
        """The last of ``samples`` (those within the period) up to which the period, copied
        once more after the ``times`` repeats, keeps every started and running id below
        ``n`` and every start within the give-up bound; None if none does."""
        limit = self.n - 1 - (times + 1) * period.ids  # the largest id that may be shifted
        top, seen, fits = -1, 0, []
        for sample in samples:
            _, base, count, state = sample
            top = max(top, max(period.started[seen : count - period.started0], default=-1))
            seen = count - period.started0
            if top > limit:
                break
            shift = base * self.kw
            if max((c + shift for c in state[0] if c is not None), default=-1) <= limit:
                fits.append(sample)
        return next((s for s in reversed(fits) if self._prefix_room(period, times, run, s)), None)

    def _prefix_room(self, period: _Period, times: int, run: dict, sample: tuple) -> bool:
        """Whether the starts of the period up to ``sample``, copied ``times + 1`` periods
        on, keep within the give-up bound (as :meth:`_room_bound`)."""
        if run["room"] is None:
            return True
        for rank, (ids, begins) in enumerate(zip(period.order, period.begins, strict=True)):
            work = period.work[rank]
            cut = bisect_right(begins, sample[0])
            if not cut or work >= period.ticks:
                continue
            room = accumulate(map(self.duration.__getitem__, ids[:cut]), initial=0)
            slack = min(map(sub, room, begins[:cut])) + run["room"][rank] - work
            if slack < (times + 1) * (period.ticks - work):
                return False
        return True

    def _resume_at(self, sample: tuple, period: _Period, times: int, run: dict) -> int:
        """After the ``times`` repeats, append the period's starts up to ``sample`` once more
        and move the state to ``sample``'s, shifted ``times + 1`` periods; returns the
        instant the scheduler resumes at."""
        sample_now, base, count, (current, ends, last_bwd, held) = sample
        ids, ticks = (times + 1) * period.ids, (times + 1) * period.ticks
        for rank, (seg, begins) in enumerate(zip(period.order, period.begins, strict=True)):
            cut = bisect_right(begins, sample_now)
            run["order"][rank] += map(add, seg[:cut], repeat(ids))
            run["ends"][rank] += map(add, period.ends[rank][:cut], repeat(ticks))
            if run["room"] is not None:
                run["room"][rank] += sum(map(self.duration.__getitem__, seg[:cut]))
        run["started"] += map(add, period.started[: count - period.started0], repeat(ids))
        now = sample_now + ticks
        shift = base * self.kw + ids
        run["current"][:] = [-1 if c is None else c + shift for c in current]
        run["end"][:] = [end + now for end in ends]
        run["last_bwd"][:], run["held"][:] = last_bwd, held
        self._refill_heaps(period, times, run, count - period.started0)
        _set_events(run)
        return now

    def _refill_heaps(self, period: _Period, times: int, run: dict, prefix: int) -> None:
        """The heaps of the state :meth:`_resume_at` moved to, from its counts: per offset
        (id mod kw) the rounds started (every kind starts its micro-batches in order) and
        the rounds done (started less running); an id is waiting when it has not started
        and its one producer is done (or it has none)."""
        kw, n, items, ids = self.kw, self.n, run["entries"].items, period.ids
        last = dict(zip(map(mod, period.started, repeat(kw)), period.started, strict=True))
        first = period.started[:prefix]  # copied times + 1 periods on, the others times
        last = {o: i + times * ids for o, i in last.items()}
        moved = map(add, first, repeat((times + 1) * ids))
        last.update(zip(map(mod, first, repeat(kw)), moved, strict=True))
        started = [last[o] // kw + 1 for o in range(kw)]  # rounds
        done = started[:]
        for action in run["current"]:
            if action >= 0:
                done[action % kw] -= 1
        rounds = -(-n // kw)
        for heaps in (run["fheap"], run["bheap"]):
            for heap in heaps:
                heap.clear()
        for o in range(kw):
            producer = self.producer_of[o]
            upto = rounds if producer < 0 else done[producer]
            heap = (run["bheap"] if o & 1 else run["fheap"])[self.rank_of[o]]
            heap += items[started[o] * kw + o : min(upto * kw + o, n) : kw]
        for heaps in (run["fheap"], run["bheap"]):
            for heap in heaps:
                heapify(heap)


def _set_events(run: dict) -> None:
    """The scheduler's events from the running actions: each rank's end."""
    due, instants, end = run["due"], run["instants"], run["end"]
    due.clear()
    for rank, action in enumerate(run["current"]):
        if action >= 0:
            due.setdefault(end[rank], []).append(rank)
    instants[:] = due
    heapify(instants)


class _Period:
    """What the scheduler did between two equal states: per rank the ids started and their
    start and end ticks, every start in order; ``ticks`` and ``ids``: the shift of one
    period."""

    def __init__(self, run: dict, t0: int, started0: int, ticks: int, ids: int, duration):
        self.order, self.begins, self.ends = [], [], []
        for order, ends in zip(run["order"], run["ends"], strict=True):
            # begun after t0: no action takes zero time, so a rank's ends rise and an
            # action ending past t0 that began by then is the one after those ended by t0
            k = bisect_right(ends, t0)
            k += k < len(ends) and ends[k] - duration[order[k]] <= t0
            self.order.append(order[k:])
            self.ends.append(ends[k:])
            self.begins.append(list(map(sub, ends[k:], map(duration.__getitem__, order[k:]))))
        self.work = [sum(map(duration.__getitem__, ids)) for ids in self.order]  # per rank
        self.started, self.started0 = run["started"][started0:], started0
        self.ticks, self.ids = ticks, ids

    def repeat(self, times: int, run: dict, watch: SteadyWatch) -> None:
        """Append ``times`` shifted copies of the period and move the state on as many."""
        ids, ticks = self.ids, self.ticks
        self._move_heaps(times * ids, run, watch.n)  # reads the state as it is
        shifts = range(1, times + 1)
        for rank, (seg, ends) in enumerate(zip(self.order, self.ends, strict=True)):
            run["order"][rank] += chain.from_iterable(
                map(add, seg, repeat(k * ids)) for k in shifts
            )
            run["ends"][rank] += chain.from_iterable(
                map(add, ends, repeat(k * ticks)) for k in shifts
            )
            if run["room"] is not None:
                run["room"][rank] += times * self.work[rank]
        run["started"] += chain.from_iterable(
            map(add, self.started, repeat(k * ids)) for k in shifts
        )
        current, end = run["current"], run["end"]
        for rank, action in enumerate(current):
            end[rank] += times * ticks
            if action >= 0:
                current[rank] = action + times * ids
        _set_events(run)

    @staticmethod
    def _move_heaps(shift: int, run: dict, n: int) -> None:
        """Each heap entry shifted, those past the last id left out."""
        items = run["entries"].items
        for heaps in (run["fheap"], run["bheap"]):
            for rank, heap in enumerate(heaps):
                moved = [items[i % n + shift] for i in heap if i % n + shift < n]
                heapify(moved)
                heaps[rank] = moved
