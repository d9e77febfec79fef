# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test bench docs lint clean

# torch first, pinned: the CPU build of 2.13.0 is what pip finds on this disk; an unpinned
# torch (asked for by transformers or d3rlpy) would pull a multi-GB CUDA build.
# setup.py builds the compiled module (offline_agent/_speedups.c): an edit to either reinstalls.
$(VENV)/.installed: pyproject.toml setup.py offline_agent/_speedups.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q -e '.[dev]'
	touch $@

# Ray is an optional extra; CI installs it so that the Ray tests run (they skip without it).
$(VENV)/.installed-ray: $(VENV)/.installed-dev
	$(PIP) install -q -e '.[dev,ray]'
	touch $@

$(VENV)/.installed-bench: $(VENV)/.installed-ray
	$(PIP) install -q -e '.[dev,ray,bench]'
	touch $@

demo: $(VENV)/.installed
	$(PY) -m offline_agent.demo --out demo-output

test: $(VENV)/.installed-dev
	$(VENV)/bin/pytest -q

# docs/cli.md from the parser (a test fails while it is stale)
docs: $(VENV)/.installed
	$(PY) -m offline_agent.cli_docs

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .

bench: $(VENV)/.installed-bench
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) demo-output .pytest_cache
