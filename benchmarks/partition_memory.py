"""Memory-balanced stage assignment on a megatron-core BERT: predicted vs measured memory.

    python benchmarks/partition_memory.py           # writes out/bench/partition_memory.md
    python benchmarks/partition_memory.py --quick   # smaller model, main tables only, no file
    python benchmarks/partition_memory.py --out docs/benchmarks/partition_memory.md

The code is :mod:`megatron_prt.bench.partition_memory`.
"""

import sys

from megatron_prt.bench.partition_memory import main

if __name__ == "__main__":
    sys.exit(main())
