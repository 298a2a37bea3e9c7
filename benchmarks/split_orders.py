"""Two zero-bubble orders of one configuration, measured side by side on the tuned grid's
stacks (2 gloo ranks, one thread each): built for equal unit stages and for the traced costs.

python benchmarks/split_orders.py --reps 41   # out/bench/split_orders.{md,json}
python benchmarks/split_orders.py --smoke     # tiny stacks, seconds
"""

import sys

from megatron_prt.bench.tuned_grid.split_orders import main

if __name__ == "__main__":
    sys.exit(main())
