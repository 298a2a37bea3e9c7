"""Choosing a plan: the layer partitioner (and, above it, the schedule tuner).

Sits above ``sim`` (it scores candidates with the simulator's cost model and replay) and below
``runtime``: stdlib only, like ``core`` and ``sim``.
"""
