"""A plan: per-rank ordered action lists plus the placement they refer to.

A plan is plain data. Generators (:mod:`megatron_prt.core.schedules`) emit compute actions
only; :func:`megatron_prt.core.lower.lower` inserts SEND/RECV. Both forms serialise to
JSON and CSV and load back unchanged.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from itertools import repeat
from operator import is_

from .actions import Action, Op, parse
from .columns import ops_of
from .placement import ConfigError, Placement

FORMAT_VERSION = 1
_VALID = "_valid_by_construction"  # where vouch() marks a plan (see vouched)
_BACKWARD = frozenset((Op.B, Op.I, Op.W))


def split_microbatches(num_microbatches: int, num_pipelines: int) -> tuple[int, ...]:
    """mb -> pipeline. Bi alternates so both pipelines start at once and consume data in order;
    an odd ``m`` gives pipeline 0 one more micro-batch."""
    if num_microbatches < 1:
        raise ConfigError(f"micro-batches must be >= 1, got {num_microbatches}")
    if num_pipelines == 2 and num_microbatches < 2:
        raise ConfigError(
            f"direction bi needs >= 2 micro-batches (one per pipeline), got {num_microbatches}; "
            "run at least 2 per call (--microbatches; megatron: num_microbatches, "
            "--global-batch-size) or use direction uni"
        )
    return tuple(mb % num_pipelines for mb in range(num_microbatches))


@dataclass(frozen=True)
class Plan:
    """``ranks[r]``: the ordered actions of pipeline rank ``r``.

    Invariants (checked by :func:`megatron_prt.core.validate.validate`): every stage of
    ``mb_pipeline[mb]``'s pipeline runs F and B of ``mb`` exactly once, on its own rank, in an
    order the dependency rule admits.
    """

    placement: Placement
    num_microbatches: int
    ranks: tuple[Sequence[Action], ...]  # tuples, or RankActions (core/columns.py)
    schedule: str = "prt"
    mb_pipeline: tuple[int, ...] = field(default=())
    lowered: bool = False

    def __post_init__(self) -> None:
        if not self.mb_pipeline:
            object.__setattr__(
                self,
                "mb_pipeline",
                split_microbatches(self.num_microbatches, self.placement.num_pipelines),
            )

    def __getstate__(self) -> dict:
        """Pickle the fields only, not what is derived from them and kept on the instance
        (:func:`megatron_prt.core.replay.compiled`)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    @property
    def split_backward(self) -> bool:
        return any(any(map(is_, ops_of(acts), repeat(Op.I))) for acts in self.ranks)

    def stages_of_mb(self, mb: int) -> tuple[int, ...]:
        return self.placement.pipelines[self.mb_pipeline[mb]]

    def compute_actions(self, rank: int) -> list[Action]:
        return [a for a in self.ranks[rank] if a.op.is_compute]

    @property
    def lanes(self) -> list[tuple[int, int]] | None:
        """Per pipeline ``(first micro-batch, step)`` when its micro-batches are evenly
        spaced to the last (what :func:`split_microbatches` makes), else None."""
        m, lanes = self.num_microbatches, []
        for pipe in range(self.placement.num_pipelines):
            own = [mb for mb, p in enumerate(self.mb_pipeline) if p == pipe]
            step = own[1] - own[0] if len(own) > 1 else m
            if own and own != list(range(own[0], m, step)):
                return None
            lanes.append((own[0], step) if own else (m, 1))
        return lanes

    @property
    def has_backward(self) -> bool:
        return any(not _BACKWARD.isdisjoint(ops_of(acts)) for acts in self.ranks)

    def forward_only(self) -> Plan:
        """The compute plan without backward (evaluation); lower it again before running."""
        ranks = tuple(tuple(a for a in acts if a.op is Op.F) for acts in self.ranks)
        return replace(self, ranks=ranks, lowered=False)

    def compute_only(self) -> Plan:
        """The plan with communication stripped (the generator's view)."""
        ranks = tuple(tuple(a for a in acts if a.op.is_compute) for acts in self.ranks)
        return replace(self, ranks=ranks, lowered=False)

    # -- serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "config": {
                **self.placement.to_dict(),
                "microbatches": self.num_microbatches,
                "schedule": self.schedule,
            },
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "stage_to_rank": list(self.placement.stage_to_rank),
            "stage_to_chunk": list(self.placement.stage_to_chunk),
            "pipelines": [list(p) for p in self.placement.pipelines],
            "mb_pipeline": list(self.mb_pipeline),
            "lowered": self.lowered,
            "ranks": {str(r): [str(a) for a in acts] for r, acts in enumerate(self.ranks)},
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        """The plan of :meth:`to_dict`'s dict. Raises ValueError for another format version
        or fields that repeat one another and disagree (an edited file)."""
        version = data.get("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise ValueError(
                f"format_version {version!r}; this megatron-prt reads {FORMAT_VERSION}: write "
                "the plan again with this version"
            )
        cfg = data["config"]
        placement = Placement(cfg["pp"], cfg["reuse"], cfg["placement"], cfg["direction"])
        if list(placement.stage_to_rank) != list(data["stage_to_rank"]):
            raise ValueError("stage_to_rank in the file disagrees with its config's placement")
        m, given = data["num_microbatches"], cfg.get("microbatches")
        if given is not None and given != m:
            raise ValueError(f"config.microbatches {given!r} disagrees with num_microbatches {m!r}")
        _check_action_count(m, placement.depth, data["ranks"])
        split_microbatches(m, placement.num_pipelines)  # its refusals hold for a given split
        _check_repeats(data, placement, m)
        ranks = tuple(
            tuple(parse(a) for a in data["ranks"][str(r)]) for r in range(placement.ranks)
        )
        return cls(
            placement=placement,
            num_microbatches=data["num_microbatches"],
            ranks=ranks,
            schedule=cfg.get("schedule", "prt"),
            mb_pipeline=tuple(data["mb_pipeline"]),
            lowered=bool(data.get("lowered", False)),
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def to_csv(self) -> str:
        """One row per rank: ``rank,<action>,<action>,...``; a ``#`` header row holds the config."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        header = json.dumps(
            {k: v for k, v in self.to_dict().items() if k not in ("ranks",)}, sort_keys=True
        )
        writer.writerow(["#" + header])
        for rank, acts in enumerate(self.ranks):
            writer.writerow([rank, *map(str, acts)])
        return out.getvalue()

    @classmethod
    def from_csv(cls, text: str) -> Plan:
        rows = list(csv.reader(io.StringIO(text)))
        if not rows or not rows[0] or not rows[0][0].startswith("#"):
            raise ValueError("plan CSV must start with a '#{...}' config row")
        meta = json.loads(",".join(rows[0])[1:])
        meta["ranks"] = {row[0]: row[1:] for row in rows[1:] if row}
        return cls.from_dict(meta)

    def fingerprint(self) -> str:
        """Stable hash of everything a rank must agree on (used to detect mismatched ranks)."""
        return hashlib.sha256(self.to_json(indent=None).encode()).hexdigest()[:16]


def _check_action_count(m: object, depth: int, ranks: dict) -> None:
    """``m`` a whole number of micro-batches that the file's actions can hold: each runs at
    least a forward at every stage of its pipeline (checked before anything sized by ``m``
    is made: a file of a few lines asking for 10**9 micro-batches ran out of memory)."""
    if type(m) is not int or m < 1:
        raise ValueError(f"num_microbatches must be a whole number >= 1, got {m!r}")
    actions = sum(len(acts) for acts in ranks.values()) if isinstance(ranks, dict) else 0
    if actions < m * depth:
        raise ValueError(
            f"num_microbatches {m} needs at least {m * depth} actions (a forward at each of "
            f"{depth} stages), the file holds {actions}: write num_microbatches as the "
            "plan's micro-batch count"
        )


def _check_repeats(data: dict, placement: Placement, m: int) -> None:
    """What the file repeats of its placement (``num_stages``, ``stage_to_chunk``,
    ``pipelines``, one ``ranks`` entry per rank) agrees with it, and ``mb_pipeline`` names one
    of its pipelines for each of the ``m`` micro-batches: a value out of range went unchecked
    for uni plans (one pipeline), and lowered the per-pipeline counts the runtime checks
    gradient hooks against."""
    derived = {
        "num_stages": placement.num_stages,
        "stage_to_chunk": list(placement.stage_to_chunk),
        "pipelines": [list(p) for p in placement.pipelines],
    }
    for key, want in derived.items():
        if key in data and data[key] != want:
            raise ValueError(f"{key} {data[key]!r} disagrees with the config's {placement}")
    ranks = data["ranks"]
    if not isinstance(ranks, dict) or set(ranks) != {str(r) for r in range(placement.ranks)}:
        keys = sorted(ranks) if isinstance(ranks, dict) else ranks
        raise ValueError(f"ranks must have entries '0'..'{placement.ranks - 1}', got {keys!r}")
    given = data["mb_pipeline"]
    pipes = placement.num_pipelines
    if not isinstance(given, list) or len(given) != m:
        raise ValueError(f"mb_pipeline must list a pipeline for each of the {m} micro-batches")
    for mb, pipe in enumerate(given):
        if type(pipe) is not int or not 0 <= pipe < pipes:
            raise ValueError(
                f"mb_pipeline: micro-batch {mb} names pipeline {pipe!r}; {placement} has "
                f"pipeline{'s 0 and 1' if pipes == 2 else ' 0'}"
            )


def vouch(plan: Plan) -> Plan:
    """Mark ``plan`` valid (what :func:`megatron_prt.core.validate.validate` checks holds)
    and return it. Only a producer that makes valid plans by construction, or a validation
    that just passed, may call this: the list scheduler (every action once, each started
    after its producers), :func:`megatron_prt.core.lower.lower` of a valid plan (SEND/RECV
    pairs adjacent in one order of events). The mark lives on this object only: a plan
    derived from it (``replace``, JSON, CSV, pickle) is checked in full."""
    object.__setattr__(plan, _VALID, True)
    return plan


def vouched(plan: Plan) -> bool:
    """Whether ``plan`` is known valid (:func:`vouch`)."""
    return plan.__dict__.get(_VALID, False)
