"""The layer stack's configurations: megatron-prt's PRT variants on each wire and
torch.distributed.pipelining's schedules, each with its baseline and twin."""

from __future__ import annotations

from dataclasses import dataclass

from ...core import Placement

NAME = "vs_torch_pipelining"
GLOO, SHM = "gloo", "shm"
PRT_TRANSPORT_ARG = {GLOO: "torch", SHM: "auto"}  # PipelineRuntime(transport=...)


# -- configurations ----------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """One row of the table. ``schedule``: a torch.distributed.pipelining class name, or ""
    for megatron-prt; ``reuse``/``placement``/``direction`` give the stage split (for torch:
    stages per rank, ``loop`` for interleaved and looped BFS, ``wave`` = V-shape for ZBV and
    DualPipeV); ``split``: megatron-prt's split-backward (``zb``) plan, F/I/W, with the
    linear layers' weight GEMMs deferred to W."""

    label: str
    transport: str  # GLOO or SHM: the wire between ranks
    reuse: int = 1
    placement: str = "loop"
    direction: str = "uni"
    schedule: str = ""
    split: bool = False

    @property
    def family(self) -> str:
        return "torch" if self.schedule else "prt"

    @property
    def key(self) -> str:
        return f"{self.label} [{self.transport}]"

    @property
    def cost_key(self) -> str:
        """The cost model its plan is built and simulated with: the wire's, and for split
        rows the one with profiled I and W times (:func:`ranks.profile_layer`)."""
        return f"{self.transport}/split" if self.split else self.transport

    def placement_for(self, ranks: int) -> Placement:
        return Placement(ranks, self.reuse, self.placement, self.direction)


PRT_VARIANTS = (  # (label, reuse, placement, direction)
    ("PRT 1F1B (R=1)", 1, "loop", "uni"),
    ("PRT loop R=2", 2, "loop", "uni"),
    ("PRT loop R=4", 4, "loop", "uni"),
    ("PRT wave R=2", 2, "wave", "uni"),
    ("PRT wave R=4", 4, "wave", "uni"),
    ("PRT wave/bi R=2", 2, "wave", "bi"),
)
ZB_VARIANTS = (  # split backward: megatron-prt's "zb" plan, (label, reuse, placement, direction)
    ("PRT zb (R=1)", 1, "loop", "uni"),
    ("PRT zb loop R=2", 2, "loop", "uni"),
    ("PRT zb loop R=4", 4, "loop", "uni"),
    ("PRT zb wave R=2", 2, "wave", "uni"),
    ("PRT zb wave R=4", 4, "wave", "uni"),
)
TORCH_SCHEDULES = (  # (class name, stages per rank, placement of those stages)
    ("Schedule1F1B", 1, "loop"),
    ("ScheduleInterleaved1F1B", 2, "loop"),
    ("ScheduleLoopedBFS", 2, "loop"),
    ("ScheduleZBVZeroBubble", 2, "wave"),
    ("ScheduleInterleaved1F1B", 4, "loop"),  # torch's answer to PRT loop R=4
    ("ScheduleInterleavedZeroBubble", 2, "loop"),
    ("ScheduleInterleavedZeroBubble", 4, "loop"),
    ("ScheduleDualPipeV", 2, "wave"),
)


def all_configs() -> list[Config]:
    prt = [
        Config(label, transport, reuse, placement, direction)
        for transport in (GLOO, SHM)
        for label, reuse, placement, direction in PRT_VARIANTS
    ]
    prt += [
        Config(label, transport, reuse, placement, direction, split=True)
        for transport in (GLOO, SHM)
        for label, reuse, placement, direction in ZB_VARIANTS
    ]
    torch_side = [
        Config(f"torch {name} ({reuse}/rank)", GLOO, reuse, placement, schedule=name)
        for name, reuse, placement in TORCH_SCHEDULES
    ]
    return prt + torch_side


def baseline_key(cfg: Config) -> str:
    """Every row is compared with megatron-prt's 1F1B over the same wire."""
    return Config(PRT_VARIANTS[0][0], cfg.transport).key


def twin_key(cfg: Config) -> str | None:
    """The megatron-prt row (gloo) with the same stage split as a torch row."""
    for label, reuse, placement, direction in PRT_VARIANTS:
        if (reuse, placement, direction) == (cfg.reuse, cfg.placement, cfg.direction):
            return Config(label, GLOO).key
    return None
