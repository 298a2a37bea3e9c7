"""Measured grid vs the tuner's pick on three CPU layer stacks (2 gloo ranks, one thread each).

python benchmarks/tuned_grid.py              # out/bench/tuned_grid.{md,json,png}
python benchmarks/tuned_grid.py --smoke      # tiny stacks, 1 repetition
"""

import sys

from megatron_prt.bench.tuned_grid import main

if __name__ == "__main__":
    sys.exit(main())
