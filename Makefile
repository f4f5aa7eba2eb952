# The two commands a new user needs (see README): `make run` and `make test`.
# Both create the virtual environment from pyproject.toml on first use.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
JOB ?= examples/frozenlake.yaml

.PHONY: run test lint protos crd clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

run: $(VENV)/.installed
	$(BIN)/stoker run $(JOB)

test: lint $(VENV)/.installed
	$(BIN)/pytest

# mypy + import-linter (see .ci/check for why they run on a symlinked tree)
lint: $(VENV)/.installed
	BIN=$(abspath $(BIN)) .ci/check

protos: $(VENV)/.installed
	$(BIN)/python -m stoker.protogen

crd: $(VENV)/.installed
	$(BIN)/stoker crd --write

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache
