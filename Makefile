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

# Flags or a model path for `tokenmill serve`/`generate`: make serve ARGS="path/to/model.gguf --port 8001"
ARGS ?=
PROMPT ?= The capital of France is

serve: setup
	$(VENV)/bin/tokenmill serve $(ARGS)

generate: setup
	$(VENV)/bin/tokenmill generate "$(PROMPT)" $(ARGS)

test: setup
	$(PY) -m ruff check tokenmill tests
	$(PY) -m pytest -q -m "not gpu"
# The kernel tests' small cases on the CPU, under Triton's interpreter: a process of its own, since the
# variable must be set before triton is imported and must not reach the run above.
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m interpret tests/kernels

lint: setup
	$(PY) -m ruff check tokenmill tests
