# Two commands on a fresh machine with python3 and make: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BASE := $(VENV)/.relax-base
DEV := $(VENV)/.relax-dev

.PHONY: demo test test-all bench install clean

# (Re)create the environment whenever pyproject.toml changes.
$(BASE): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $(BASE)

# Test tools plus CPU torch + transformers for the parity tests (never used at runtime).
$(DEV): $(BASE)
	$(PY) -m pip install --quiet -e '.[dev,parity]'
	touch $(DEV)

install: $(BASE)

demo: $(BASE)
	$(PY) examples/train_grpo.py

test: $(DEV)
	$(PY) -m pytest -q tests

# Includes the tests marked slow.
test-all: $(DEV)
	$(PY) -m pytest -q -m '' tests

bench: $(DEV)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache
