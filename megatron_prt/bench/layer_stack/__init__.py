"""Layer-stack section of ``megatron-prt bench``: PRT side by side with 1F1B and
torch.distributed.pipelining (CPU, one thread per rank).

One launch of P gloo ranks runs every configuration on the same model (an MLP layer stack),
the same data and the same stage split: megatron-prt's PRT schedules (R=1 is 1F1B) and its
split-backward ``zb`` plans (F/I/W, weight GEMMs deferred to W) over gloo
(``transport="torch"``) and over shared memory (``transport="auto"``, the CPU default), and
torch.distributed.pipelining's Schedule1F1B, ScheduleInterleaved1F1B (2 and 4 stages per
rank), ScheduleLoopedBFS, ScheduleInterleavedZeroBubble (2 and 4), ScheduleZBVZeroBubble and
ScheduleDualPipeV (gloo). Repetitions are interleaved (a seeded shuffle per round: A C B, B
A C, ...) and reported as medians; torch's gradients are checked against megatron-prt's for
the same stage split. Next to each measurement: the simulator's prediction for the plan that
ran (torch's schedules converted to plans) from per-layer costs
(for the zb rows: the backward split into input and weight gradient in the proportions of
their thread CPU times, :func:`ranks.profile_split`, and the bytes held until I and from I
until W, which also cap the zb plans at 1F1B's simulated peak),
per-message costs and (bi) the replica-gradient sum's cost, all profiled in the same launch
(:func:`replica_calibration`), and each rank's peak activation bytes
held for backward, counted by megatron_prt.runtime.memory.ActivationMeter on a separate,
untimed step. :func:`run` writes ``vs_torch_pipelining.{md,png,json}`` under ``args.out``.
"""

from __future__ import annotations

from ...runtime.local import all_ok, run_local
from ..common import say
from ..report import launch
from .configs import all_configs
from .ranks import worker
from .results import summarize, write_outputs

__all__ = ["all_configs", "run"]


# -- entry point ---------------------------------------------------------------------------
def run(args, command: str) -> list[str]:
    """Run the section on ``args.ranks`` local gloo ranks (flags:
    :mod:`megatron_prt.bench.flags`), write the report, chart and data under ``args.out``;
    returns their paths. ``command`` is the command line quoted in the report."""
    say(f"layer stack: {args.ranks} ranks, m in {args.microbatches}, {args.reps} repetitions")
    ranks, info = launch(
        command, lambda: all_ok(run_local(args.ranks, worker, args, deadline_s=3000))
    )
    return write_outputs(args, summarize(args, ranks), info)
