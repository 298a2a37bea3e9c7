"""Per-stage durations the generators and the simulator agree on (plain numbers, any unit)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .actions import Action, Op
from .placement import cut_index


@dataclass(frozen=True)
class StageTimes:
    """``fwd[k]``/``bwd[k]``: time of model stage ``k`` (``k`` in ``[0, D)``; bi replicas share
    it) for one micro-batch. ``p2p``: latency of one cross-rank hop, a number (every cut
    alike) or one per cut (``p2p[k]``: between model stages ``k`` and ``k + 1``, ``D - 1``
    of them, a forward's activation and a backward's gradient alike; :meth:`cut_hop`);
    same-rank hand-offs cost 0. ``p2p_cpu``: time one message also takes from its sender's
    and its receiver's compute (CPU transports copy through the kernel; NCCL on GPUs is
    close to 0). It is charged to the compute action that produces or consumes the
    message.

    Split backward: ``wgt[k]`` is the weight-gradient (W) part of ``bwd[k]``, the
    input-gradient (I) part is ``bwd[k] - wgt[k]``; ``None`` splits every backward in
    half. Plans without I/W never read it."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    p2p: float | tuple[float, ...] = 0.0
    p2p_cpu: float = 0.0
    wgt: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        # tuples whatever the caller gave: the planners cache by stage times (hashable)
        for name in ("fwd", "bwd") + (() if self.wgt is None else ("wgt",)):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if not isinstance(self.p2p, (int, float)):
            object.__setattr__(self, "p2p", _cut_hops(tuple(self.p2p), len(self.fwd)))
        if self.wgt is not None and (
            len(self.wgt) != len(self.bwd)
            or any(not 0 <= w <= b for w, b in zip(self.wgt, self.bwd, strict=True))
        ):
            raise ValueError(
                f"wgt must give every stage a weight-gradient time in [0, bwd]: wgt={self.wgt}"
                f", bwd={self.bwd}"
            )

    @classmethod
    def uniform(cls, depth: int, fwd: float = 1.0, bwd: float = 2.0, p2p: float = 0.0):
        """Uniform stages; ``fwd``/``bwd`` are per *stage*, not per model."""
        return cls((fwd,) * depth, (bwd,) * depth, p2p)

    def in_ticks(self, resolution: int = 10_000) -> tuple[StageTimes, float]:
        """Integer copy (and the tick length) so that event ties are exact: a schedule must
        not change with the time unit or with float rounding (1/6 + 1/6 != 2/6). The tick is
        ``1/resolution`` of the shortest positive F, B, hop or message CPU time; W times do
        not choose it (plans without I/W never read them, and must not move with the W
        share), so a W under half a tick rounds to 0."""
        hops = self.p2p if isinstance(self.p2p, tuple) else (self.p2p,)
        positive = [t for t in (*self.fwd, *self.bwd, *hops, self.p2p_cpu) if t > 0]
        tick = min(positive) / resolution if positive else 1.0
        as_ticks = lambda ts: tuple(round(t / tick) for t in ts)  # noqa: E731
        wgt = None if self.wgt is None else as_ticks(self.wgt)
        if wgt is not None:  # rounding must keep I = B - W >= 0
            wgt = tuple(min(w, b) for w, b in zip(wgt, as_ticks(self.bwd), strict=True))
        return (
            StageTimes(
                as_ticks(self.fwd),
                as_ticks(self.bwd),
                as_ticks(hops) if isinstance(self.p2p, tuple) else round(self.p2p / tick),
                round(self.p2p_cpu / tick),
                wgt,
            ),
            tick,
        )

    @property
    def per_cut(self) -> bool:
        """Whether the cuts' hops differ (``p2p`` a tuple); else ``p2p`` is every cut's."""
        return isinstance(self.p2p, tuple)

    @property
    def longest_hop(self) -> float:
        """The largest cut's hop (``p2p`` when every cut is alike)."""
        return max(self.p2p, default=0) if isinstance(self.p2p, tuple) else self.p2p

    def cut_hop(self, stage: int, other: int) -> float:
        """Hop of the message between neighbouring stages ``stage`` and ``other`` (stage
        ids of one pipeline: model stages mod ``D``) when they sit on different ranks; the
        caller knows whether they do."""
        if not isinstance(self.p2p, tuple):
            return self.p2p
        return self.p2p[cut_index(stage, other, len(self.fwd))]

    def busy(self, action: Action, placement) -> float:
        """Rank time of ``action``: its compute plus ``p2p_cpu`` per message it receives or
        sends (a neighbouring stage on another rank; ``W`` has no message)."""
        base = self.duration(action)
        if not self.p2p_cpu or action.op is Op.W:
            return base
        rank = placement.rank_of(action.stage)
        messages = sum(
            1
            for nb in (placement.prev_stage(action.stage), placement.next_stage(action.stage))
            if nb is not None and placement.rank_of(nb) != rank
        )
        return base + messages * self.p2p_cpu

    def duration(self, action: Action) -> float:
        k = action.stage % len(self.fwd)
        if action.op is Op.F:
            return self.fwd[k]
        if action.op is Op.B:
            return self.bwd[k]
        if action.op in (Op.I, Op.W):
            wgt = self.wgrad(k)
            return wgt if action.op is Op.W else self.bwd[k] - wgt
        return 0.0

    def wgrad(self, k: int) -> float:
        """Weight-gradient (W) time of model stage ``k``; the rest of ``bwd[k]`` is I."""
        if self.wgt is not None:
            return self.wgt[k]
        return self.bwd[k] // 2 if isinstance(self.bwd[k], int) else self.bwd[k] / 2

    def with_wgrad_fraction(self, fraction: float) -> StageTimes:
        """These times with W = ``fraction`` of every backward (0 <= fraction <= 1)."""
        if not 0 <= fraction <= 1:
            raise ValueError(f"wgrad fraction must be in [0, 1], got {fraction}")
        return replace(self, wgt=tuple(b * fraction for b in self.bwd))


def _cut_hops(hops: tuple, depth: int) -> float | tuple:
    """Per-cut hops checked (``depth - 1`` numbers >= 0), and one number when they are all
    alike: the planners' and the replay's paths for equal cuts stay as they are, and equal
    times hash alike whichever way they were given."""
    if len(hops) != max(depth - 1, 0) or any(
        not isinstance(h, (int, float)) or not h >= 0 for h in hops
    ):
        raise ValueError(
            f"p2p per cut must give {max(depth - 1, 0)} hop times >= 0 (one between each two "
            f"of the {depth} stages), got {hops}"
        )
    if len(set(hops)) <= 1:
        return hops[0] if hops else 0.0
    return hops
