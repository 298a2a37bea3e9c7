"""The plain-PyTorch examples refuse impossible flags with one line and exit status 2, as
argparse does, instead of a traceback from every rank (a layout whose stages the layers
cannot fill, stage counts that do not sum to the model's layers, counts that are not
integers, R or m below 1, a --trace directory that cannot be made)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# mlp_pipeline checks before joining the group (2 ranks asked, none started); resnet_pipeline
# checks once it knows the model's layers, so it runs as the one rank of a 1-rank group
CASES = [
    ("mlp_pipeline.py", ["--reuse", "8"], "--layers 8 cannot fill D = R*P = 16 stages"),
    ("mlp_pipeline.py", ["--reuse", "0"], "reuse must be an integer >= 1, got 0"),
    ("mlp_pipeline.py", ["--microbatches", "0"], "micro-batches must be an integer >= 1"),
    (
        "resnet_pipeline.py",
        ["--reuse", "16"],
        "--arch resnet18's layer count 10 cannot fill D = R*P = 16 stages",
    ),
    (
        "resnet_pipeline.py",
        ["--stage-layers", "3,3"],
        "--stage-layers 3,3 must give D = R*P = 2 counts",
    ),
    ("resnet_pipeline.py", ["--stage-layers", "3,x"], "expected comma-separated integers"),
    (  # torchvision's BatchNorm weights were taken by GroupNorm's parameters of the same name
        "resnet_pipeline.py",
        ["--weights", "w.pth", "--norm", "group"],
        "--weights with --norm group: torchvision's norm weights are BatchNorm's",
    ),
    (  # the run trained, then failed writing the trace, with a traceback from every rank
        "mlp_pipeline.py",
        ["--trace", "/nonexistent/dir/prt"],
        "--trace /nonexistent/dir/prt: directory /nonexistent/dir neither exists nor can be",
    ),
    (
        "resnet_pipeline.py",
        ["--trace", "/nonexistent/dir/prt"],
        "--trace /nonexistent/dir/prt: directory /nonexistent/dir neither exists nor can be",
    ),
]


@pytest.mark.parametrize(("example", "flags", "message"), CASES)
def test_examples_refuse_impossible_flags_in_one_line(example, flags, message):
    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2" if example == "mlp_pipeline.py" else "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
    }
    data = ["--data", "synthetic"] if example == "resnet_pipeline.py" else []
    cmd = [sys.executable, str(EXAMPLES / example), *flags, *data, "--steps", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{example}: error:") and message in last, last
