"""Where every stage lives: the one module that owns the stage -> (rank, chunk) rule.

Stages ``0..D-1`` (``D = reuse * ranks``) form pipeline 0 in flow order. With direction
``bi`` a second pipeline runs the same model the other way round: its stages ``D..2D-1`` are
numbered in *its own* flow order, stage ``D + j`` computes the same layers as stage ``j`` (a
weight replica) and sits on the mirrored rank ``P-1-rank(j)``.

Placement of pipeline 0 (``pass = stage // P``, ``pos = stage % P``):

* ``loop``: rank ``pos`` in every pass, so data always flows 0..P-1 and then wraps.
* ``wave``: rank ``pos`` in even passes and ``P-1-pos`` in odd ones, so each turn between
  passes is a same-rank hand-off and rank 0 holds both an early and a late stage.

Chunks are local indices: pass ``k`` of pipeline 0 is chunk ``k``; pipeline 1 adds ``R``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

PLACEMENTS = ("loop", "wave")
DIRECTIONS = ("uni", "bi")


def cut_index(stage: int, other: int, depth: int) -> int:
    """The cut an edge between neighbouring stages ``stage`` and ``other`` crosses: ``k``,
    the boundary of model stages ``k`` and ``k + 1`` (a pipeline of ``depth`` stages; bi's
    pipeline 1, stages ``D .. 2D - 1``, crosses the same cuts as pipeline 0)."""
    return min(stage, other) % depth


class ConfigError(ValueError):
    """A configuration that cannot be planned; the message names the knob and the fix."""


@dataclass(frozen=True)
class Placement:
    """``ranks`` P >= 1, ``reuse`` R >= 1, ``placement`` loop|wave, ``direction`` uni|bi."""

    ranks: int
    reuse: int = 1
    placement: str = "loop"
    direction: str = "uni"

    def __post_init__(self) -> None:
        if not isinstance(self.ranks, int) or self.ranks < 1:
            raise ConfigError(f"pipeline ranks must be an integer >= 1, got {self.ranks!r}")
        if not isinstance(self.reuse, int) or self.reuse < 1:
            raise ConfigError(f"reuse must be an integer >= 1, got {self.reuse!r}")
        if self.placement not in PLACEMENTS:
            raise ConfigError(
                f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}"
            )
        if self.direction not in DIRECTIONS:
            raise ConfigError(
                f"direction must be one of {', '.join(DIRECTIONS)}, got {self.direction!r}"
            )

    # -- sizes ---------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        """D = R * P: stages one micro-batch crosses."""
        return self.reuse * self.ranks

    @property
    def num_pipelines(self) -> int:
        return 2 if self.direction == "bi" else 1

    @property
    def num_stages(self) -> int:
        """All stage ids, both pipelines: ``D`` (uni) or ``2D`` (bi)."""
        return self.depth * self.num_pipelines

    @property
    def chunks_per_rank(self) -> int:
        return self.reuse * self.num_pipelines

    # -- the rule --------------------------------------------------------------------------
    def _rank_in_pipeline0(self, stage: int) -> int:
        pass_, pos = divmod(stage, self.ranks)
        if self.placement == "wave" and pass_ % 2 == 1:
            return self.ranks - 1 - pos
        return pos

    def locate(self, stage: int) -> tuple[int, int]:
        """Stage -> (rank, chunk). Raises ``IndexError`` for an unknown stage."""
        if not 0 <= stage < self.num_stages:
            raise IndexError(f"stage {stage} out of range [0, {self.num_stages})")
        pipeline, local = divmod(stage, self.depth)
        rank = self._rank_in_pipeline0(local)
        chunk = local // self.ranks
        if pipeline == 1:
            return self.ranks - 1 - rank, chunk + self.reuse
        return rank, chunk

    @cached_property
    def stage_to_rank(self) -> tuple[int, ...]:
        return tuple(self.locate(s)[0] for s in range(self.num_stages))

    @cached_property
    def stage_to_chunk(self) -> tuple[int, ...]:
        return tuple(self.locate(s)[1] for s in range(self.num_stages))

    def rank_of(self, stage: int) -> int:
        return self.stage_to_rank[stage]

    def pipeline_of(self, stage: int) -> int:
        return stage // self.depth

    def model_stage(self, stage: int) -> int:
        """The model slice a stage computes: ``stage mod D`` (bi replicas share it)."""
        return stage % self.depth

    @cached_property
    def pipelines(self) -> tuple[tuple[int, ...], ...]:
        """Stage ids of each pipeline in flow order."""
        d = self.depth
        return tuple(tuple(range(p * d, (p + 1) * d)) for p in range(self.num_pipelines))

    @cached_property
    def rank_stages(self) -> tuple[tuple[int, ...], ...]:
        """rank -> its stages ordered by chunk."""
        by_rank: list[list[int]] = [[] for _ in range(self.ranks)]
        for stage in range(self.num_stages):
            by_rank[self.rank_of(stage)].append(stage)
        return tuple(
            tuple(sorted(stages, key=lambda s: self.stage_to_chunk[s])) for stages in by_rank
        )

    def prev_stage(self, stage: int) -> int | None:
        """Upstream neighbour in the same pipeline, or None for a pipeline's first stage."""
        return None if stage % self.depth == 0 else stage - 1

    def next_stage(self, stage: int) -> int | None:
        """Downstream neighbour in the same pipeline, or None for a pipeline's last stage."""
        return None if stage % self.depth == self.depth - 1 else stage + 1

    def replica_pairs(self) -> tuple[tuple[int, int], ...]:
        """``(k, D + k)`` for every model stage ``k`` under ``bi``: a stage and its weight
        replica, whose gradients are summed; empty for ``uni``."""
        if self.direction != "bi":
            return ()
        return tuple((k, self.depth + k) for k in range(self.depth))

    def end_pairs(self) -> tuple[tuple[int, int], ...]:
        """``(first, last)`` stage of each pipeline: where a model that ties its input
        embedding to its output weight holds the two copies whose gradients are summed
        after the step (one pair per pipeline, so two under ``bi``). Both on one rank (wave
        with even R) the sum is local; a pipeline of one stage (D = 1) holds the weight
        once, so it has no pair."""
        return tuple((p[0], p[-1]) for p in self.pipelines if len(p) > 1)

    def is_first(self, stage: int) -> bool:
        return stage % self.depth == 0

    def is_last(self, stage: int) -> bool:
        return stage % self.depth == self.depth - 1

    def to_dict(self) -> dict:
        return {
            "pp": self.ranks,
            "reuse": self.reuse,
            "placement": self.placement,
            "direction": self.direction,
        }
