# perflab: the two commands are `make report` and `make test` (see README.md).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.perflab-installed
SUITE   ?= smoke
PARAMS  ?=
PYTEST_ARGS ?=

.PHONY: setup report test test-unit lint lab lab-reset ceilings docs baseline clean

LOCK    := requirements/lab.txt

$(STAMP): pyproject.toml $(LOCK)
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned by the lock: a bare or open-range torch would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q -c $(LOCK) torch
	# torch's CUDA build pins its own triton (3.7.1 for 2.13.0); the CPU build brings none: take ours.
	$(BIN)/python -m pip show -q triton >/dev/null 2>&1 || $(BIN)/python -m pip install -q triton==3.9.0
	# the project with every extra the lab and its tests use, at the lab's exact pins
	$(BIN)/python -m pip install -q -c $(LOCK) -e '.[lab,export,dev]'
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (perflab)" >/dev/null
	touch $(STAMP)

setup: $(STAMP)

## Run the smoke suite headless on CPU and print the report's index.html.
report: $(STAMP)
	$(BIN)/perflab run $(SUITE) $(PARAMS)

## The linter and the formatter (ruff, configured in pyproject.toml), over the whole tree.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

## Every test: lint, unit tests, runner, browser tests (skipped without Chromium), nbval over labs/.
## TEST_WORKERS pytest-xdist workers (0: one process). More workers than cores: the suite is
## CPU-bound, and on a CI machine shared with other jobs each worker is one more share of the cores.
TEST_WORKERS ?= 4
test: lint
	$(BIN)/python -m pytest $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS)) $(PYTEST_ARGS)

## The fast tier: the unit tests of every room (tests/unit/, mirroring lab_utils/ and lab_kernels/),
## without the slow ones; no smoke run, no browser, no cluster. UNIT_WORKERS xdist workers (0: one
## process): one per core of a 2-core machine, since nothing here waits on a cluster or a browser.
UNIT_WORKERS ?= 2
test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit -m "not slow" $(if $(filter-out 0,$(UNIT_WORKERS)),-n $(UNIT_WORKERS)) $(PYTEST_ARGS)

## JupyterLab on working copies of labs/ in work/labs/ (git-ignored; made on first use, then kept),
## so autosave never touches the committed notebooks. JUPYTER_ARGS go to `jupyter lab`.
JUPYTER_ARGS ?=
lab: $(STAMP)
	$(BIN)/perflab lab -- $(JUPYTER_ARGS)

## Fresh working copies: all of them, or one with LAB=05_memory (the old copy is replaced).
LAB ?=
lab-reset: $(STAMP)
	$(BIN)/perflab lab --reset $(LAB)

ceilings: $(STAMP)
	$(BIN)/perflab ceilings --force

## The API reference (pdoc, from the docstrings) into build/api/; make test builds it too.
docs: $(STAMP)
	$(BIN)/python docs/api.py build/api

## Refresh this device kind's stored baseline from a fresh smoke run (commit first: it records the commit).
baseline: $(STAMP)
	$(BIN)/perflab baseline refresh --suite $(SUITE) --timing-free

clean:
	rm -rf $(VENV) reports .perflab
