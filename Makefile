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
# The kernel tests' small cases on the CPU, under Triton's interpreter: a process of its own, since the
# variable must be set before triton is imported and must not reach the main run. It runs beside the main run,
# on the core the engines under test leave free (one torch thread each); its output is printed after.
	@TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider -m interpret tests/kernels > .interpret-tests.log 2>&1 & \
	interpret=$$!; \
	$(PY) -m pytest -q -m "not gpu"; main=$$?; \
	wait $$interpret; kernels=$$?; \
	echo "== kernel tests under Triton's interpreter"; cat .interpret-tests.log; rm -f .interpret-tests.log; \
	test $$main -eq 0 && test $$kernels -eq 0

lint: setup
	$(PY) -m ruff check tokenmill tests
