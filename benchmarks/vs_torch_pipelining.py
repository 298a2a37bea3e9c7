"""The layer-stack section of ``megatron-prt bench`` alone (kept for old commands):

    python benchmarks/vs_torch_pipelining.py [flags]  # = megatron-prt bench --model layers [flags]

Flags and output as ``megatron-prt bench --help`` (``vs_torch_pipelining.{md,png,json}``
under ``--out``); the code is :mod:`megatron_prt.bench.layer_stack`.
"""

import sys

from megatron_prt.bench.sections import main

if __name__ == "__main__":
    if any(arg == "--model" or arg.startswith("--model=") for arg in sys.argv[1:]):
        # a later --model would win and run another section under this script's name
        print(
            "vs_torch_pipelining.py: error: --model is fixed to layers here; for another "
            "section run megatron-prt bench --model ...",
            file=sys.stderr,
        )
        sys.exit(2)
    sys.exit(main(["--model", "layers", *sys.argv[1:]]))
