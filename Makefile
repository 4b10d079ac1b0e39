# The two set-up commands of README: `make run` (main job) and `make test` (the test suite).
# Contributors: `make test-fast` (everything but the runs of verl's trainer and Ray clusters, marked slow) and `make lint`.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup run test test-fast lint format bench demo

setup:
	bash scripts/bootstrap.sh

run: setup
	$(VENV)/bin/verl-cppack grpo

test: setup
	$(PY) -m pytest -q

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
