"""How long planning takes (build, validate, lower): see megatron_prt/bench/planner_speed.py.

python benchmarks/planner_speed.py
python benchmarks/planner_speed.py 64,8,wave,bi,512 --no-lower
"""

import sys

from megatron_prt.bench.planner_speed import main

if __name__ == "__main__":
    sys.exit(main())
