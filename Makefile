# One-command entry points. Everything the project needs is installed from here into .venv.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup run test test-all bench bench-quick proto clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[spark,dev,bench]'
	touch $(STAMP)

setup: $(STAMP)

## Run the main job: a local cluster (1 JobManager, 2 TaskManagers), RocksDB, file:// checkpoints,
## the example PySpark streaming pipeline, one TaskManager killed midway, results verified.
run: $(STAMP)
	$(PY) -m keyedstate.examples.main_job

## The default test suite (what CI runs).
test: $(STAMP)
	$(PY) -m pytest -q

## Everything, including soak runs marked slow.
test-all: $(STAMP)
	$(PY) -m pytest -q -m ''

bench-quick: $(STAMP)
	$(PY) -m bench --quick

bench: $(STAMP)
	$(PY) -m bench

## Regenerate common/_proto from proto/ (needs the dev extra).
proto: $(STAMP)
	$(PY) proto/generate.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
