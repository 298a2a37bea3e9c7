"""Choosing a plan: the layer partitioner (and, above it, the schedule tuner).

Sits above ``sim`` (it scores candidates with the simulator's cost model, core's replay and
the simulator's memory rule) and below ``runtime``: stdlib only, like ``core`` and ``sim``.

Modules, bottom up: ``memory`` (a rank's peak from in-flight vectors), ``problem`` (what does
not change with the partition, stage costs, admissible partitions), ``evaluate`` (simulated
partitions, critical paths, objectives), ``state`` (the surrogate and its move screening),
``search`` (the heuristic), ``partition`` (the entry point and its results).
"""
