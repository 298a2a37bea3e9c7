"""megatron-prt: pipeline reuse (PRT) schedules for megatron-core."""

__version__ = "0.1.0"
