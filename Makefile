# megatron-prt developer commands. `make test` works from a fresh clone on a CPU-only machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml requirements-dev.txt | cksum | cut -d' ' -f1)

.PHONY: install test test-all lint format clean golden bench bench-runtime demo docker docker-demo gpu-smoke \
	test-megatron-next megatron-lm-smoke

install: $(STAMP)

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -e .
	rm -f $(VENV)/.installed-* && touch $@

# Test processes: one per core, at most 4 (0: in this process, on one core). Each test file
# runs whole on one process, so its module fixtures (a trained example run) are built once.
# The 15 slowest tests are listed at the end: what to look at when CI nears its 15 minutes.
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -ge 4 ] && echo 4 || { [ $$n -ge 2 ] && echo $$n || echo 0; })
PYTEST    := $(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --durations=15

test: install
	$(PYTEST)

test-all: install
	$(PYTEST) -m "slow or not slow"

# The megatron-facing tests against the next megatron-core line (requirements-next.txt) on
# Python 3.12, in their own venv. Not in CI: the first run installs ~2.6 GB of wheels.
NEXT_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3) python3.12)
NEXT_VENV   ?= .venv-next
NEXT_TESTS  ?= tests/megatron/test_megatron_args.py tests/megatron/test_megatron_cpu.py \
	tests/megatron/test_megatron_lm_glue.py tests/megatron/test_megatron_order.py tests/megatron/test_megatron_parity.py \
	tests/megatron/test_megatron_training.py tests/examples/test_pretrain_bert.py tests/megatron/test_megatron_lm_cpu.py \
	tests/megatron/test_megatron_lm_ckpt.py tests/megatron/test_split_backward_megatron.py \
	tests/megatron/test_tune_megatron_flag.py tests/megatron/test_megatron_auto.py \
	tests/megatron/test_megatron_te_spec.py tests/megatron/test_checkpoint_format.py \
	tests/megatron/test_megatron_unsupported.py tests/megatron/test_megatron_ckpt.py
NEXT_STAMP  := $(NEXT_VENV)/.installed-$(shell cat pyproject.toml requirements-next.txt | cksum | cut -d' ' -f1)
$(NEXT_STAMP): pyproject.toml requirements-next.txt
	test -x $(NEXT_VENV)/bin/python || $(NEXT_PYTHON) -m venv $(NEXT_VENV)
	$(NEXT_VENV)/bin/python -m pip install --quiet -r requirements-next.txt
	$(NEXT_VENV)/bin/python -m pip install --quiet --no-deps -e .
	rm -f $(NEXT_VENV)/.installed-* && touch $@
test-megatron-next: $(NEXT_STAMP)
	$(NEXT_VENV)/bin/python -m pytest -q -x $(NEXT_TESTS)

# Upstream Megatron-LM (a checkout with patches/ applied) trained on 4 CPU ranks by its own
# training loop with PRT, checkpoint saved and resumed (scripts/megatron_lm_smoke.sh,
# docs/gpu.md): make megatron-lm-smoke MEGATRON_LM=/path/to/Megatron-LM PYTHON_MLM=venv/bin/python
megatron-lm-smoke:
	PYTHON=$(or $(PYTHON_MLM),python3) scripts/megatron_lm_smoke.sh $(MEGATRON_LM)

lint: install
	$(VENV)/bin/ruff check megatron_prt tests benchmarks examples scripts
	$(VENV)/bin/ruff format --check megatron_prt tests benchmarks examples scripts
	$(VENV)/bin/hadolint Dockerfile
	bash -n scripts/gpu_smoke.sh scripts/megatron_lm_smoke.sh

format: install
	$(VENV)/bin/ruff format megatron_prt tests benchmarks examples scripts

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info

golden: install
	MEGATRON_PRT=$(abspath $(VENV))/bin/megatron-prt tests/golden/regenerate.sh

# Measured side by side on local CPU ranks (a benchmark, not a test): megatron-prt's 1F1B and
# PRT variants, torch.distributed.pipelining's schedules (layer stack) and megatron-core BERT,
# with the simulator's predictions; report, chart and data in $(BENCH_OUT) (megatron-prt bench).
# The committed reports name their flags (README, "Measured speed"): BENCH_FLAGS passes them.
BENCH_OUT ?= out/bench
BENCH_FLAGS ?=
bench: install
	$(VENV)/bin/megatron-prt bench --out $(BENCH_OUT) $(BENCH_FLAGS)

# Runtime speed vs the simulator, R = 1, 2, 4 on shared memory (benchmarks/runtime_speed.py).
bench-runtime: install
	$(PY) benchmarks/runtime_speed.py

# BERT pretraining on 4 CPU ranks (torchrun, one thread each): PRT R=2 wave against 1F1B
# (--pipeline-reuse 1), side by side, with PNG timelines in out/demo/ (examples/demo.py).
# 4 ranks, or one per core when there are fewer: ranks sharing a core time-slice, which
# hides the bubble PRT removes (override: make demo DEMO_RANKS=4).
DEMO_RANKS ?= $(shell n=$$(nproc 2>/dev/null || echo 4); [ $$n -ge 4 ] && echo 4 || echo $$n)
demo: install
	OMP_NUM_THREADS=1 $(PY) examples/demo.py --out out/demo --ranks $(DEMO_RANKS)

# GPU servers (docs/gpu.md): the NGC-based image with Megatron-LM + patches/ + megatron-prt.
IMAGE ?= megatron-prt
DOCKER_RUN := docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 --rm
docker:
	docker build -t $(IMAGE) .

# BERT pretraining with PRT (wave, R=2) against 1F1B on every GPU of this machine, inside the
# image: examples/demo.py with --device cuda (timelines in out/demo). Pipeline ranks take one
# GPU each over NCCL, so with fewer than 2 GPUs the demo runs on 4 CPU ranks instead.
docker-demo: docker
	$(DOCKER_RUN) -v $(CURDIR)/out:/workspace/out $(IMAGE) bash -c \
	  'n=$$(python -c "import torch; print(torch.cuda.device_count())"); \
	  if [ $$n -ge 2 ]; then \
	    python /opt/megatron-prt/examples/demo.py --device cuda --ranks $$n --out /workspace/out/demo; \
	  else \
	    echo "docker-demo: $$n GPU; a pipeline needs 2 (one rank per GPU): 4 CPU ranks instead" >&2; \
	    OMP_NUM_THREADS=1 python /opt/megatron-prt/examples/demo.py --ranks 4 --out /workspace/out/demo; \
	  fi'

gpu-smoke:
	scripts/gpu_smoke.sh
