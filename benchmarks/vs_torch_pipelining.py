"""The layer-stack section of ``megatron-prt bench`` alone (kept for old commands):

    python benchmarks/vs_torch_pipelining.py [flags]  # = megatron-prt bench --model layers [flags]

Flags and output as ``megatron-prt bench --help`` (``vs_torch_pipelining.{md,png,json}``
under ``--out``); the code is :mod:`megatron_prt.bench.layer_stack`.
"""

import sys

from megatron_prt.bench.sections import main

if __name__ == "__main__":
    sys.exit(main(["--model", "layers", *sys.argv[1:]]))
