# The two commands of the README: `make demo` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_mlp.py

test: $(STAMP)
	$(PY) -m ruff format --check jax_sm100 tests examples benchmarks
	$(PY) -m ruff check jax_sm100 tests examples benchmarks
	$(PY) -m pytest -n 2 -q tests

lint: $(STAMP)
	$(PY) -m ruff format --check jax_sm100 tests examples benchmarks
	$(PY) -m ruff check jax_sm100 tests examples benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
