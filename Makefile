# The two set-up commands of the README: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
DEMO   := trainguard-runs/demo

.PHONY: demo test lint bench clean

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

# The Debian packages and the OTLP receiver the tests run for real are installed up front (the
# fixtures would install them too, but inside a test's time limit). The layering contracts
# (pyproject.toml [tool.importlinter], README "Layout") are checked before the tests.
test: $(VENV)/.installed
	$(PY) -c "from tests.services.telemetry_services import apt_ensure, rotel_binary; apt_ensure('prometheus', 'prometheus-alertmanager', 'chromium', 'slurm-wlm', 'munge', 'iproute2', 'etcd-server'); rotel_binary()"
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) trainguard-runs
