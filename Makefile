# rankwise: the two commands a new machine needs are `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rankwise-installed
TORCH_VERSION := 2.13.0

.PHONY: demo test setup bench bench-smoke bench-large clean

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

# Benchmarks are for an idle machine (hours on one thread: RANKWISE_BENCH_THREADS, RANKWISE_BENCH_LLM=0 to
# skip the LLM-shaped decompositions); the JSON goes to benchmarks/results/, the table to docs/benchmarks.md.
bench: $(STAMP)
	$(BIN)/python -m benchmarks.run
	$(BIN)/python -m benchmarks.table

# Each benchmark's smallest case once: checks that they run (results/smoke/, never tabulated).
bench-smoke: $(STAMP)
	$(BIN)/python -m benchmarks.run --smoke --no-memory
	$(BIN)/python -m benchmarks.large_checkpoint --smoke

# A >= 2 GB checkpoint compressed under a memory cap of half its size (writes ~3 GB to a temp dir).
bench-large: $(STAMP)
	$(BIN)/python -m benchmarks.large_checkpoint --size-gb 2
	$(BIN)/python -m benchmarks.table

clean:
	rm -rf report .pytest_cache
