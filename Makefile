# The two commands of the README: `make serve` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup serve generate test lint

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: this machine's CPU build lies on disk; an unpinned torch pulls CUDA.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(VENV)/bin/tokenmill serve

generate: setup
	$(VENV)/bin/tokenmill generate "The capital of France is"

test: setup
	$(PY) -m ruff check tokenmill tests
	$(PY) -m pytest -q -m "not gpu"

lint: setup
	$(PY) -m ruff check tokenmill tests
