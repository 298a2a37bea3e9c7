"""A checkpoint of a newer megatron-core's format is refused as such, not called damaged."""

from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("megatron.core")

from megatron.core import dist_checkpointing

from megatron_prt.megatron.bert_checkpoint import (
    _read_common,
    checkpoint_dir,
    layout,
    reads_newer_format,
    restores_rng,
)


def _folder(root, metadata: dict, common: bool) -> None:
    folder = checkpoint_dir(str(root), 3)
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text(json.dumps(metadata))
    (folder / ".metadata").write_bytes(b"")
    if common:
        (folder / "common.pt").write_bytes(b"not a pickle")
    (root / "latest").write_text("3")


@pytest.mark.parametrize(
    ("metadata", "common", "said"),
    [  # megatron-core 0.19 writes no common.pt and names no common_backend
        ({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, False, "0.19 or newer"),
        (
            {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
             "common_backend": "torch", "common_backend_version": 1},
            True,
            "truncated, damaged",
        ),
    ],
)  # fmt: skip
def test_a_newer_format_is_named_and_a_damaged_one_is_not(tmp_path, metadata, common, said):
    """A checkpoint saved under megatron-core 0.19 and loaded under 0.16 was called
    truncated or damaged, with the advice to start again without --load; under 0.19 a
    damaged one escaped the check (torch's CheckpointException is no Exception)."""
    if not hasattr(dist_checkpointing, "load_common_state_dict"):
        pytest.skip("megatron-core without load_common_state_dict")
    _folder(tmp_path, metadata, common)
    if "common_backend" not in metadata and reads_newer_format():
        said = "truncated, damaged"  # it reads the format: a folder of no tensors is damaged
    iteration, state, problem = _read_common(argparse.Namespace(load=str(tmp_path)))
    assert iteration == 3 and state is None
    assert said in problem, problem


def test_rng_states_restore_only_on_the_grid_and_device_they_were_saved_on():
    """A checkpoint saved on CUDA restored its 16-byte CUDA tracker states into a CPU run's
    generators (a crash at the first dropout): the device decides too."""
    import argparse

    def run(device="cpu", pp=2, tp=1):
        return argparse.Namespace(
            pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
            data_parallel_size=1, reuse=None, device=device,
        )  # fmt: skip

    saved = layout(run("cuda"))
    assert restores_rng(saved, run("cuda"))
    assert not restores_rng(saved, run("cpu"))
    assert not restores_rng(saved, run("cuda", pp=4)) and not restores_rng(saved, run("cuda", tp=2))
    before = {k: v for k, v in saved.items() if k != "device"}  # saved before it was recorded
    assert restores_rng(before, run("cpu")) and restores_rng(before, run("cuda"))
