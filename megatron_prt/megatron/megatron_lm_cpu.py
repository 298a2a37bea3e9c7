"""Run a patched Megatron-LM training script (``pretrain_gpt.py``, ``pretrain_bert.py``) on
CPU ranks: for tests and smoke runs of the real ``megatron.training`` loop without a GPU.

    torchrun --nproc-per-node 4 -m megatron_prt.megatron.megatron_lm_cpu \\
        pretrain_gpt.py --distributed-backend gloo --transformer-impl local ... \\
        --pipeline-model-parallel-size 2 --pipeline-reuse 2 --pipeline-reuse-placement wave

(``scripts/megatron_lm_smoke.sh`` is the full command.) On top of
:func:`megatron_prt.megatron.cpu.enable` (megatron-core's CUDA assumptions), :func:`enable`
covers what ``megatron.training`` assumes (Megatron-LM at tags ``core_v0.16.1`` and
``core_v0.19.0``):

* ``initialize_megatron`` asserts ``torch.cuda.is_available()`` unless ``allow_no_cuda``:
  ``pretrain()`` never passes it, so the harness does.
* ``_initialize_distributed`` and ``_set_random_seed`` skip ``initialize_model_parallel``
  and the model-parallel seeds when ``torch.cuda.device_count()`` is 0: the training modules
  see one device, ``set_device`` a no-op.
* ``pretrain_bert.py`` imports megatron-core's Transformer Engine BERT spec, which raises
  ``ImportError`` without TE: the name imports as ``None`` and the harness requires
  ``--spec local`` for that script.
* ``_compile_dependencies`` builds the legacy fused kernels with ``nvcc``: not loaded (the
  local spec on CPU calls none of them).
* timers, the rerun state machine, the loss / grad-norm reductions of the training loop
  and the checkpoint code allocate with ``device="cuda"`` or ``torch.cuda.current_device()``
  and synchronize (``get_model`` sets DDP up on a side stream): their module ``torch`` is
  the :class:`~megatron_prt.megatron.cpu.CpuTorch` proxy, with a ``torch.cuda`` whose memory
  statistics are 0 (the memory report prints zeros: there is no device memory to report),
  ``empty_cache`` and ``set_device`` no-ops, and streams that never wait.
* processes megatron starts with ``spawn`` (``torch_dist``'s writer) set up by importing the
  harness, not by re-running the script (whose imports need the harness).
* RNG state in checkpoints: ``torch.cuda.get_rng_state()`` would initialise CUDA; the CPU
  generator's state is saved in its place and restored the same way.

Never import this in a process that uses CUDA: :func:`enable` refuses once CUDA is
initialised, and a CPU run never initialises it (every CUDA call it reaches is replaced).
"""

from __future__ import annotations

import functools
import importlib
import os
import runpy
import sys
import types

import torch

from . import cpu

# megatron.training (and megatron.core helpers it drives) modules whose ``torch`` becomes the
# CPU proxy: each allocates on, or synchronizes, the current CUDA device. The last group
# exists from core_v0.19 only (``utils`` became a package; the model is built and wrapped in
# ``models.dist_utils``) and is skipped where absent.
_TRAINING_MODULES = (
    "megatron.training.initialize",
    "megatron.training.training",
    "megatron.training.utils",
    "megatron.training.checkpointing",
    "megatron.training.global_vars",
    "megatron.core.timers",
    "megatron.core.rerun_state_machine",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.data",
    "megatron.core.parallel_state",
    "megatron.core.dist_checkpointing.strategies.torch",
)
_LATER_TRAINING_MODULES = (
    "megatron.training.utils.common_utils",
    "megatron.training.models.dist_utils",
)


class _TrainingCuda(cpu.CpuCuda):
    """``torch.cuda`` for megatron.training on CPU: one device (the CPU), no memory."""

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def set_device(device) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def get_rng_state(device="cuda"):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, device="cuda") -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed) -> None:
        return None

    def __getattr__(self, name):
        if "memory" in name and (name.endswith(("allocated", "reserved"))):
            return _no_memory
        return getattr(torch.cuda, name)


def _no_memory(device=None) -> int:
    return 0


class TrainingTorch(cpu.CpuTorch):
    cuda = _TrainingCuda()


def enable() -> None:
    """Make ``megatron.training`` run on CPU ranks, process-wide (idempotent). Raises
    RuntimeError when CUDA is initialised in this process."""
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "megatron_prt.megatron.megatron_lm_cpu: CUDA is initialised in this process; the "
            "CPU harness replaces megatron's CUDA calls process-wide and is for CPU-only runs"
        )
    cpu.enable()
    proxy = TrainingTorch()
    for name in _TRAINING_MODULES:
        importlib.import_module(name).torch = proxy
    for name in _LATER_TRAINING_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as missing:
            if not name.startswith(missing.name or "?"):
                raise  # one of its own imports is missing: a broken install, not an old tag
            continue
        module.torch = proxy
    from megatron.training import initialize, training

    _import_bert_specs_without_te()
    _spawned_processes_import_the_harness()
    # Megatron-LM's legacy fused kernels are CUDA sources compiled with nvcc; the local spec on
    # CPU calls none of them.
    initialize.fused_kernels = types.SimpleNamespace(load=_no_fused_kernels)
    if not getattr(initialize.initialize_megatron, "cpu_harness", False):
        allow = _allow_no_cuda(initialize.initialize_megatron)
        initialize.initialize_megatron = training.initialize_megatron = allow


def _import_bert_specs_without_te() -> None:
    """``pretrain_bert.py`` imports ``bert_layer_with_transformer_engine_spec``, which
    megatron-core builds on first access and refuses without Transformer Engine: the name is
    bound to ``None`` so the script imports; :func:`main` requires ``--spec local``, so the
    name is never used."""
    from megatron.core.models.bert import bert_layer_specs

    try:
        bert_layer_specs.bert_layer_with_transformer_engine_spec  # noqa: B018 (the import test)
    except ImportError:
        bert_layer_specs.bert_layer_with_transformer_engine_spec = None


def _spawned_processes_import_the_harness() -> None:
    """A process started with ``spawn`` (``torch_dist``'s writer starts its results queue's
    manager so) first re-runs the parent's main module; under the harness that is the script,
    whose top-level imports need the harness (``pretrain_bert.py``'s Transformer Engine spec)
    and fail there, ending the save. Such a process imports this module instead: it needs
    nothing of the script (megatron sends it megatron's own functions)."""
    from multiprocessing import spawn

    if getattr(spawn.get_preparation_data, "cpu_harness", False):
        return
    original = spawn.get_preparation_data

    @functools.wraps(original)
    def preparation_data(name):
        data = original(name)
        if data.pop("init_main_from_path", None) is not None:
            data["init_main_from_name"] = "megatron_prt.megatron.megatron_lm_cpu"
        return data

    preparation_data.cpu_harness = True  # type: ignore[attr-defined]
    spawn.get_preparation_data = preparation_data


def _no_fused_kernels(args) -> None:
    return None


def _allow_no_cuda(initialize_megatron):
    @functools.wraps(initialize_megatron)
    def initialize(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    initialize.cpu_harness = True  # type: ignore[attr-defined]
    return initialize


def main(argv: list[str] | None = None) -> None:
    """``python -m megatron_prt.megatron.megatron_lm_cpu SCRIPT [ARGS...]``: run SCRIPT as
    ``__main__`` with the CPU harness enabled (its directory first on ``sys.path``)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or not argv[0].endswith(".py"):
        raise SystemExit("usage: python -m megatron_prt.megatron.megatron_lm_cpu SCRIPT.py ARGS")
    script = os.path.abspath(argv[0])
    if os.path.basename(script) == "pretrain_bert.py" and "--spec" not in argv:
        raise SystemExit(
            "pretrain_bert.py on CPU needs --spec local: its default layer spec is Transformer "
            "Engine's, which needs CUDA"
        )
    sys.path.insert(0, os.path.dirname(script))
    enable()
    sys.argv = [script, *argv[1:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
