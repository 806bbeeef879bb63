# Two commands on a fresh machine (see README): `make demo` and `make test`.
# PIP_EXTRA lets a user add e.g. `--extra-index-url https://download.pytorch.org/whl/cpu` to get the CPU torch
# wheel on a Linux box without a GPU (PyPI's default torch wheel for Linux carries CUDA and is several GB).
PYTHON ?= python3
VENV ?= .venv
PIP_EXTRA ?=
PY := $(VENV)/bin/python

.PHONY: setup setup-test demo plan-demo test test-fast test-unit test-integration test-cluster test-gpu lint docs gpu-check clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

setup: $(PY)
	$(PY) -m pip install -q $(PIP_EXTRA) "torch==2.13.0" -e .

setup-test: $(PY)
	$(PY) -m pip install -q $(PIP_EXTRA) "torch==2.13.0" -e ".[test,hf,track]"

demo: setup
	$(VENV)/bin/flexorch train --config examples/train_laptop.toml

plan-demo: setup
	$(VENV)/bin/flexorch plan --workers 64 --profile gpt-7b-a100 --max-context 384K --batch 512 --steps 5 --svg runs/plan.svg

# The suite by level (docs/tests.md): tests/unit (no Ray), tests/integration (a local Ray), tests/cluster (multi-node
# clusters, `ray start`, `ray job submit`), tests/gpu (CUDA; skipped without a GPU). `make test` runs every level.
test: setup-test
	$(PY) -m pytest -q --durations=30

# The unit level without its few tests marked slow: a couple of minutes, no Ray.
test-fast: setup-test
	$(PY) -m pytest -q -m "not slow" tests/unit

test-unit test-integration test-cluster test-gpu: test-%: setup-test
	$(PY) -m pytest -q --durations=10 tests/$*

lint: setup-test
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# The documentation site (mkdocs.yml, docs/) into site/: --strict makes every warning (a broken link or anchor, a
# page outside the nav) an error; docs/hooks.py generates the config, CLI, size and test reference from the code.
docs: setup
	$(PY) -m pip install -q $(PIP_EXTRA) -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# The GPU check (benchmarks/gpu/gpu_check.py): CUDA tests, attention kernels, SP on one GPU, a 1.1B step, a calibrated
# profile; its table goes under runs/gpu_check/. `make gpu-check ARGS=--dry` runs it on CPU. On a lent GPU machine
# (torch, no Ray, no venv) run it from the repository root as `python3 -m benchmarks.gpu.gpu_check`.
gpu-check: setup-test
	$(PY) -m benchmarks.gpu.gpu_check $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info runs site
