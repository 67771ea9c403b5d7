# One-command entry points. Everything the project needs is installed from here into .venv.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup run test test-all test-exhaustive test-deps browser-deps metrics-deps metrics-doc check typecheck-tree format bench bench-quick bench-deps proto clean

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

## The default test suite (what CI runs): the house checks first, then pytest.
test: check test-deps bench-deps browser-deps metrics-deps
	$(PY) -m pytest -q

## The house checks: lint, format, types (mypy --strict) and the import-layer contracts.
check: $(STAMP) typecheck-tree
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	cd build/typecheck && MYPYPATH=. ../../$(VENV)/bin/mypy --config-file ../../pyproject.toml \
		-p keyedstate.common -p keyedstate.jobmanager -p keyedstate.taskmanager -p keyedstate.state_processor -p keyedstate.cli -p keyedstate.examples \
		-p bench -p tests
	PYTHONPATH=build/typecheck $(VENV)/bin/lint-imports pyproject.toml

## mypy and import-linter see the top-level folders under their import root (keyedstate.common, ...),
## as the installed package does; a tree of symlinks gives them that view without moving a file.
typecheck-tree:
	@mkdir -p build/typecheck/keyedstate
	@for f in common jobmanager taskmanager state_processor cli examples; do ln -sfn ../../../$$f build/typecheck/keyedstate/$$f; done
	@for f in bench tests; do ln -sfn ../../$$f build/typecheck/$$f; done

## Rewrites the code in the house format and applies the safe lint fixes.
format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

## Everything: the default suite plus the exhaustive tier (variants a default test covers per failure
## class and commit mode), the soak and benchmark runs marked slow, fuzz_long and chaos_soak.
test-all: $(STAMP) test-deps bench-deps browser-deps metrics-deps
	$(PY) -m pytest -q -m ''

## Only the exhaustive tier (each test names the default test that covers its failure class).
test-exhaustive: $(STAMP) test-deps
	$(PY) -m pytest -q -m exhaustive

## iptables makes the network partitions of the netns tests (tests/fixtures/netns.py); Debian's package.
## systemd-analyze and systemd-sysusers check deploy/systemd (tests/integration/deploy); Debian's systemd.
test-deps:
	@command -v iptables >/dev/null 2>&1 || (apt-get install -y -qq iptables >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq iptables)) \
		|| echo "test-deps: iptables could not be installed; the netns partition tests will be skipped"
	@command -v systemd-analyze >/dev/null 2>&1 || (apt-get install -y -qq systemd >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq systemd)) \
		|| echo "test-deps: systemd-analyze could not be installed; tests/integration/deploy will fail"

## Headless Chromium for the web UI test (tests/integration/rest/test_web_ui.py), Debian's packages;
## playwright drives /usr/bin/chromium (never `playwright install`). Under make the test fails without it.
browser-deps:
	@command -v chromium >/dev/null 2>&1 || (apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium chromium-driver)) \
		|| echo "browser-deps: chromium could not be installed; the web UI test will fail under make test"

## Prometheus (with promtool) proves deploy/prometheus and deploy/grafana against a live cluster
## (tests/integration/observability); Debian's package, started by the test itself.
metrics-deps:
	@command -v prometheus >/dev/null 2>&1 || (apt-get install -y -qq prometheus >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq prometheus)) \
		|| echo "metrics-deps: prometheus could not be installed; the Prometheus tests will fail"
	@systemctl disable --now prometheus >/dev/null 2>&1 || true

## Regenerate docs/metrics.md from the metric declarations (a test fails when it is stale).
metrics-doc: $(STAMP)
	$(PY) -m keyedstate.cli.metrics_doc > docs/metrics.md

## Redis is a baseline in the benchmarks; Debian's package, started by the benchmark itself.
bench-deps:
	@command -v redis-server >/dev/null 2>&1 || (apt-get install -y -qq redis-server >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq redis-server)) \
		|| echo "bench-deps: redis-server could not be installed; the Redis baselines will be reported as skipped"
	@systemctl disable --now redis-server >/dev/null 2>&1 || true

## Benchmarks (opt-in): quick mode (< 2 min) and the full run behind bench/RESULTS.md.
bench-quick: $(STAMP) bench-deps
	$(PY) -m bench --quick

bench: $(STAMP) bench-deps
	$(PY) -m bench

## Regenerate common/_proto from proto/ (needs the dev extra).
proto: $(STAMP)
	$(PY) proto/generate.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
