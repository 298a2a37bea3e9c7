"""Planning core: actions, placement, the dependency rule, generators, validation, lowering.

Pure standard library: importing it loads neither torch nor megatron.
"""

from .actions import Action, Op, parse
from .placement import ConfigError, Placement
from .plan import Plan
from .schedules import SCHEDULES, build_plan
from .timing import StageTimes

__all__ = [
    "SCHEDULES",
    "Action",
    "ConfigError",
    "Op",
    "Placement",
    "Plan",
    "StageTimes",
    "build_plan",
    "parse",
]
