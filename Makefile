# Two commands on a fresh machine (see README): `make demo` and `make test`.
# PIP_EXTRA lets a user add e.g. `--extra-index-url https://download.pytorch.org/whl/cpu` to get the CPU torch
# wheel on a Linux box without a GPU (PyPI's default torch wheel for Linux carries CUDA and is several GB).
PYTHON ?= python3
VENV ?= .venv
PIP_EXTRA ?=
PY := $(VENV)/bin/python

.PHONY: setup setup-test demo plan-demo test test-fast lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

setup: $(PY)
	$(PY) -m pip install -q $(PIP_EXTRA) "torch==2.13.0" -e .

setup-test: $(PY)
	$(PY) -m pip install -q $(PIP_EXTRA) "torch==2.13.0" -e ".[test,hf]"

demo: setup
	$(VENV)/bin/flexorch train --config examples/train_laptop.toml

plan-demo: setup
	$(VENV)/bin/flexorch plan --workers 64 --profile gpt-7b-a100 --max-context 384K --batch 512 --steps 5 --svg runs/plan.svg

test: setup-test
	$(PY) -m pytest -q

test-fast: setup-test
	$(PY) -m pytest -q -m "not slow"

lint: setup-test
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info runs
