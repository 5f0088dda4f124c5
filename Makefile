# The two set-up commands of the README: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
DEMO   := trainguard-runs/demo

.PHONY: demo test test-checks test-services test-soak lint bench clean

# The venv sees system site-packages so a torch the user already has is kept; where no torch
# is importable, the CPU build torch==2.13.0 is installed (a bare `torch` pulls CUDA, GBs).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	rm -rf $(DEMO)
	$(VENV)/bin/trainguard run --standalone --nproc-per-node 2 --max-restarts 3 --tg-run-dir $(DEMO) \
	    examples/train_mlp.py --steps 200 --step-sleep 0.05 --fail-at-step 120 --fail-rank 1
	@$(VENV)/bin/trainguard report -q $(DEMO) >/dev/null
	@echo
	@echo "Run directory: $(DEMO)  (events.jsonl, metrics/, checkpoints/, config.json)"
	@echo "Report:        $(DEMO)/report.html  (loss, throughput, goodput, failures and recoveries)"
	@echo "Metrics:       $(DEMO)/metrics/rank_*.jsonl and telemetry/; while a job runs, its node's"
	@echo "               Prometheus endpoint is in $(DEMO)/prometheus_<node>.json"
	@echo "Events:        $(VENV)/bin/trainguard events $(DEMO)"

# Everything the tests run outside Python: these Debian packages and the rotel OTLP receiver,
# installed while the venv is built and checked (lint, format, types; tests/services/preflight.py
# names any binary still missing, in one line, before the first test). Then the suite in
# parallel: one pytest-xdist worker per group of tests that share a service
# (pytest.mark.xdist_group), the rest spread over TEST_WORKERS, the slow tests first.
# `make test TESTS=tests/test_spares.py` runs one file; `make test-soak` the soak tests.
# The suite starts ~1500 Python processes; compileall first, so that none of them compiles the
# package from source (where PYTHONDONTWRITEBYTECODE is set, none would write the cache).
TEST_DEBS    := prometheus prometheus-alertmanager chromium slurm-wlm munge iproute2 etcd-server etcd-client
TEST_WORKERS ?= 3
TESTS        ?=

test:
	@$(MAKE) --no-print-directory -j2 -O test-checks test-services
	$(PY) -m compileall -q trainguard tests examples bench
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=10 $(TESTS)

# Lint, format and type checks; the Debian packages and the rotel receiver are installed
# meanwhile (stdlib only: no venv needed).
test-checks: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test-services:
	PYTHONPATH=. $(PYTHON) -c "from tests.services.telemetry_services import apt_ensure, rotel_binary; apt_ensure(*'$(TEST_DEBS)'.split()); rotel_binary()"

test-soak: $(VENV)/.installed
	$(PY) -m pytest -q -m soak $(TESTS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) trainguard-runs
