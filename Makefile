# The two set-up commands of README: `make run` (main job) and `make test` (the test suite).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup run test bench

setup:
	bash scripts/bootstrap.sh

run: setup
	$(VENV)/bin/verl-cppack demo

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/bench_core.py
