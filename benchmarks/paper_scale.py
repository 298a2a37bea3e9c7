"""PRT at the paper's scale, simulated: BERT and ResNet on 8 GPUs (no GPU used).

    python benchmarks/paper_scale.py                  # writes out/bench/paper_scale.md
    python benchmarks/paper_scale.py --quick          # m=8 only, no extras; prints the report
    python benchmarks/paper_scale.py --out docs/benchmarks  # the committed one

The code is :mod:`megatron_prt.bench.paper_scale` (costs: :mod:`megatron_prt.sim.analytic`).
"""

import sys

from megatron_prt.bench.paper_scale import main

if __name__ == "__main__":
    sys.exit(main())
