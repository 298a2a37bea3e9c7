# megatron-prt developer commands. `make test` works from a fresh clone on a CPU-only machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml requirements-dev.txt | cksum | cut -d' ' -f1)

.PHONY: install test test-all lint format clean golden bench

install: $(STAMP)

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -e .
	rm -f $(VENV)/.installed-* && touch $@

test: install
	$(PY) -m pytest -q

test-all: install
	$(PY) -m pytest -q -m "slow or not slow"

lint: install
	$(VENV)/bin/ruff check megatron_prt tests benchmarks examples

format: install
	$(VENV)/bin/ruff format megatron_prt tests benchmarks examples

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info

golden: install
	MEGATRON_PRT=$(CURDIR)/$(VENV)/bin/megatron-prt tests/golden/regenerate.sh

# Measured runtime speed on this machine vs the simulator (a benchmark, not a test).
bench: install
	$(PY) benchmarks/runtime_speed.py
