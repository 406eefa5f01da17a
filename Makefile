# `make run` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test lint format bench clean proto

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU torch wheel first, so no dependency pulls a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/moe-cluster up

test: install
	$(VENV)/bin/ruff check services tests benchmarks proto
	$(PY) -m pytest -q --durations=25 tests

lint: install
	$(VENV)/bin/ruff check services tests benchmarks proto
	$(VENV)/bin/ruff format --check services tests benchmarks

format: install
	$(VENV)/bin/ruff check --fix services tests benchmarks
	$(VENV)/bin/ruff format services tests benchmarks

proto: install
	$(PY) proto/generate.py

bench: install
	$(VENV)/bin/moe-cluster bench all

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
