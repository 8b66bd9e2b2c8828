# rankwise: the two commands a new machine needs are `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rankwise-installed
TORCH_VERSION := 2.13.0

.PHONY: demo test setup bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install --quiet -e ".[all]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/rankwise report --quick

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf report .pytest_cache
