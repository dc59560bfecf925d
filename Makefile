# The README's two commands: `make demo` and `make test`. Both create (or reuse) ./.venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint

$(STAMP): pyproject.toml $(wildcard setup.py) $(wildcard shardpar/csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: the local CPU wheel. A bare `torch` would pull the newest CUDA build (GBs).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/shardpar demo

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check shardpar tests benchmarks recipes
	$(VENV)/bin/mypy
