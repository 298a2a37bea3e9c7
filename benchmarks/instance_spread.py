"""Runtimes of one plan timed side by side: how far apart twins measure (2 gloo ranks, CPU).

python benchmarks/instance_spread.py              # out/bench/instance_spread.{md,json}
python benchmarks/instance_spread.py --smoke      # tiny stack, seconds
"""

import sys

from megatron_prt.bench.instance_spread import main

if __name__ == "__main__":
    sys.exit(main())
