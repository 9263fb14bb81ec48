# The two commands in the README are the contract:
#   make run    set up everything, then train the default job (2 torchrun workers)
#   make test   set up everything, then run the test suite (make test-all: with the extended tier)
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: setup setup-extended run test test-all test-fast lint bench clean

setup:
	@VENV=$(VENV) bash scripts/setup.sh

# setup, and what only the extended tests need (the Optuna sweeper, the etcd rendezvous)
setup-extended:
	@VENV=$(VENV) STEADFAST_EXTENDED=1 bash scripts/setup.sh

run: setup
	$(PY) -m pipeline.train $(ARGS)

test: setup
	PY=$(PY) bash scripts/test.sh $(ARGS)

test-all: setup-extended
	TEST_TIER=all PY=$(PY) bash scripts/test.sh $(ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(ARGS)

lint: setup
	VENV=$(VENV) bash scripts/lint.sh

bench: setup
	$(PY) -m bench.run_all $(ARGS)

clean:
	rm -rf outputs multirun .pytest_cache
