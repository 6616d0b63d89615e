# Two commands on a fresh machine with python3 and make: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.relax-installed

.PHONY: demo test test-all bench install clean

# (Re)create the environment whenever pyproject.toml changes.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,parity]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_grpo.py

test: $(STAMP)
	$(PY) -m pytest -q tests

# Includes the tests marked slow.
test-all: $(STAMP)
	$(PY) -m pytest -q -m '' tests

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache
