# The two commands of the README: `make demo` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-newest-jax lint clean

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

# The suite on the newest JAX release, which needs Python >= 3.12 (`make test` takes what the
# default python3 installs; JAX 0.11 and 0.12 changed how sharded custom calls lower).
PYTHON_NEW ?= python3.12
VENV_NEW := .venv-newest-jax

test-newest-jax:
	test -x $(VENV_NEW)/bin/python || $(PYTHON_NEW) -m venv $(VENV_NEW)
	$(VENV_NEW)/bin/python -m pip install -q --upgrade pip
	$(VENV_NEW)/bin/python -m pip install -q --upgrade -e '.[test]' jax jaxlib
	$(VENV_NEW)/bin/python -c "import jax; print('jax', jax.__version__)"
	$(VENV_NEW)/bin/python -m pytest -n 2 -q tests

lint: $(STAMP)
	$(PY) -m ruff format --check jax_sm100 tests examples benchmarks
	$(PY) -m ruff check jax_sm100 tests examples benchmarks

clean:
	rm -rf $(VENV) $(VENV_NEW) build *.egg-info
