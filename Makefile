# Two commands on a fresh machine with python3 and make: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BASE := $(VENV)/.relax-base
DEV := $(VENV)/.relax-dev
DOCS := $(VENV)/.relax-docs

.PHONY: demo test test-all lint bench install clean docs

# Host memory in 2 MiB pages where the kernel offers them on request (THP mode `madvise`).
# XLA:CPU allocates each call's temporaries afresh, and glibc maps blocks that large straight from
# the kernel, so every call faults its scratch in again, 4 KiB at a time: ~0.1 s of a 3.3 s GRPO
# iteration on 2 cores (benchmarks/RESULTS.md). glibc >= 2.35 reads this; older ones ignore it.
export GLIBC_TUNABLES := $(if $(GLIBC_TUNABLES),$(GLIBC_TUNABLES):)glibc.malloc.hugetlb=1

# (Re)create the environment whenever pyproject.toml changes.
$(BASE): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $(BASE)

# Test tools, math-verify, CPU torch + transformers for the parity tests (never used at runtime),
# the training service's server and client (starlette, uvicorn, msgpack, httpx), qwix for the
# 8-bit sampler, libtpu, whose compile-only client the planner's tests compile TPU programs
# with (no TPU), reasoning-gym and verifiers (the ecosystem's tasks), and lm-evaluation-harness
# (the reference relax eval is checked against).
$(DEV): $(BASE)
	$(PY) -m pip install --quiet -e '.[dev,parity,math,tpu,serve,quant,tasks,eval]'
	touch $(DEV)

install: $(BASE)

demo: $(BASE)
	$(PY) examples/train_grpo.py

# The tests not marked slow (pyproject.toml's addopts: -m 'not slow'), one worker per core, each
# test file on one worker (its module fixtures built once), the heaviest files first (conftest.py).
test: $(DEV)
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder tests

# ruff (pyproject.toml's [tool.ruff]): lint rules, import order, and the formatter's layout.
lint: $(DEV)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Includes the tests marked slow.
test-all: $(DEV)
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder -m '' tests

bench: $(DEV)
	$(PY) benchmarks/run_all.py

# The documentation site (mkdocs.yml): the user guide and the API reference generated from the
# docstrings, built into site/ with --strict (a warning, a broken link or an unlisted page fails).
$(DOCS): $(BASE)
	$(PY) -m pip install --quiet -e '.[docs]'
	touch $(DOCS)

docs: $(DOCS)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) .pytest_cache
