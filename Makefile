# The two set-up commands of README: `make run` (main job) and `make test` (the test suite).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup run test bench demo

setup:
	bash scripts/bootstrap.sh

run: setup
	$(VENV)/bin/verl-cppack grpo

test: setup
	$(PY) -m pytest -q

demo: setup
	$(VENV)/bin/verl-cppack demo

bench: setup
	$(VENV)/bin/verl-cppack bench
