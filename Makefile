# The two set-up commands of README: `make run` (main job) and `make test` (the test suite, on both tested stacks).
# Contributors: `make test-fast` (everything but the tests marked slow, pinned stack), `make test-current` (the
# current stack alone) and `make lint`.
VENV ?= .venv
PY := $(VENV)/bin/python
CURRENT ?= .venv-current
CURRENT_PY := $(CURRENT)/bin/python
# verl main's megatron-core pin: the current stack's fast tests run again with it laid over 0.19.2 (PYTHONPATH)
MEGATRON_018 := megatron-core==0.18.2
OVERLAY_018 := $(CURRENT)/overlay-megatron-core-0.18.2

.PHONY: setup setup-current run test test-pinned test-current test-fast lint format bench demo

setup:
	bash scripts/bootstrap.sh

setup-current:
	STACK=current VENV=$(CURRENT) bash scripts/bootstrap.sh

run: setup
	$(VENV)/bin/verl-cppack grpo

test: test-pinned test-current

test-pinned: setup
	$(PY) -m pytest -q

test-current: setup-current
	$(CURRENT_PY) -m pytest -q -m "not slow or stacks"
	[ -d $(OVERLAY_018) ] || $(CURRENT_PY) -m pip install --quiet --disable-pip-version-check --no-deps --target $(OVERLAY_018) $(MEGATRON_018)
	PYTHONPATH=$(OVERLAY_018) $(CURRENT_PY) -m pytest -q -m "not slow"

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

demo: setup
	$(VENV)/bin/verl-cppack demo

bench: setup
	$(VENV)/bin/verl-cppack bench
