"""megatron-prt's 1F1B against torch.distributed.pipelining's Schedule1F1B over gloo:

    python benchmarks/gloo_1f1b.py --microbatches 4,8 --reps 41 [--zb]

Prints medians of interleaved steps (wall and CPU time) and the ratios; the code is
:mod:`megatron_prt.bench.layer_stack.gloo_1f1b`.
"""

import sys

from megatron_prt.bench.layer_stack.gloo_1f1b import main

if __name__ == "__main__":
    sys.exit(main())
