"""Measured vs simulated speed of the runtime on this machine (CPU, gloo, one thread/rank).

    python benchmarks/runtime_speed.py                 # P=2, 8-layer MLP, hidden 768, mb 16, m=2
    python benchmarks/runtime_speed.py --microbatches 8 --reps 9

Prints its table (no file); the code is :mod:`megatron_prt.bench.runtime_speed`.
"""

import sys

from megatron_prt.bench.runtime_speed import main

if __name__ == "__main__":
    sys.exit(main())
