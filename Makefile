# Narwhal: `make demo` shows tokens streaming through the router; `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: venv demo fleet test lint typecheck unit rough-bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

demo: venv           ## two fake engines + the router; stream one chat completion
	$(PY) -m narwhal demo --port 0

fleet: venv          ## the same, kept running on :8000 for curl
	$(PY) -m narwhal demo --keep --port 8000

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: venv
	$(PY) -m mypy

unit: venv
	$(PY) -m pytest -q

test: lint typecheck unit

rough-bench: venv    ## first rough figure: 1,000 streamed 64-token requests at c=32
	$(PY) bench/rough.py --requests 1000 --concurrency 32 --tokens 64

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
