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

# End-to-end files that run in the second run, to even the two out (on 2 cores the end-to-end tests alone took 12:21,
# the other run 7:13; with these moved 10:39 and 11:10, and `make test` 12:28 in all from a fresh clone).
E2E_BESIDE := tests/e2e/test_structured_outputs.py tests/e2e/test_data_parallel_experts.py

test: setup
	$(PY) -m ruff check tokenmill tests
	@$(PY) -c "from tokenmill.default_model import default_model_path; default_model_path()"  # once, before both runs
# Two runs side by side, one per core (each engine under test takes one torch thread): the end-to-end tests, and
# the kernel tests' small cases under Triton's interpreter (the variable must be set before triton is imported and
# must not reach the other runs, hence a process of its own) followed by the unit, model and kernel tests and
# E2E_BESIDE. The second run's output is printed after the first's.
	@( TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider -m interpret tests/kernels; kernels=$$?; \
	   $(PY) -m pytest -q -m "not gpu" tests/unit tests/models tests/kernels $(E2E_BESIDE); others=$$?; \
	   test $$kernels -eq 0 && test $$others -eq 0 ) > .unit-tests.log 2>&1 & \
	units=$$!; \
	$(PY) -m pytest -q -m "not gpu" tests/e2e $(addprefix --ignore=,$(E2E_BESIDE)); e2e=$$?; \
	wait $$units; units_rc=$$?; \
	echo "== kernel tests under Triton's interpreter, then the unit, model and kernel tests and $(E2E_BESIDE)"; \
	cat .unit-tests.log; \
	rm -f .unit-tests.log; test $$e2e -eq 0 && test $$units_rc -eq 0

lint: setup
	$(PY) -m ruff check tokenmill tests
