# Two commands on a fresh machine: `make demo` and `make test` (each sets up what it needs).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TW     := $(VENV)/bin/tensorwire
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup demo test soak lint bench bench-algo docs clean

$(STAMP): pyproject.toml setup.py $(wildcard src/tensorwire/transport/_native.[ch] src/tensorwire/transport/_caller.c)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch==2.13.0 exactly: the CPU build on this machine (any other spec pulls CUDA wheels)
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test,bf16,bench]"
	touch $@

setup: $(STAMP)

demo: setup
	$(TW) run -n 4 examples/demo.py
	$(TW) bench all_reduce -b 8 -e 16M -f 8 -n 10 -w 3 --np 4

test: setup
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -p no:cacheprovider --durations=25

# Random collectives, ops, dtypes, sizes (0-4 MiB), subgroups and async calls on 4 ranks, every
# result checked against numpy, on shared memory then TCP (SOAK_SEED=N reproduces a run)
soak: setup
	$(PY) tests/soak.py --np 4 --steps 20000 --transport both

lint: setup
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/mypy

# tensorwire vs Gloo vs Open MPI, the same sweep interleaved over 3 rounds, at 2 and 4 ranks:
# tables (markdown, with the command and the machine), plots and JSON in docs/benchmarks/.
# n=4 stops at 64 MiB: 4 ranks share 2 cores there, and the budget is ~15 minutes in all.
BENCH_SWEEP := all -b 8 -f 4 -n auto -w auto --compare gloo,mpi
bench: setup
	$(TW) bench $(BENCH_SWEEP) -e 256M --np 2 --json docs/benchmarks/compare-n2.json \
		--plot docs/benchmarks/compare-n2.png --markdown docs/benchmarks/compare-n2.md
	$(TW) bench $(BENCH_SWEEP) -e 64M --np 4 --json docs/benchmarks/compare-n4.json \
		--plot docs/benchmarks/compare-n4.png --markdown docs/benchmarks/compare-n4.md

# Every algorithm of every collective against the tuner and the cost model, in issue 4's three
# settings (shm n=4, TCP n=4, 4 netns hosts at 1 Gbit/s; the last needs root): about 20 minutes
bench-algo: setup
	$(PY) bench/algo_sweep.py --out-dir docs/benchmarks

# The API reference from the docstrings (Sphinx, pages in docs/reference/) into build/docs/index.html,
# warnings as errors, afresh each time (-E: a page kept from the last build would hide its warnings).
# The suite builds it too (tests/test_docs.py); the extra caps Sphinx's and MyST's major versions,
# since a new one may add warnings.
DOCS_STAMP := $(VENV)/.docs-stamp
$(DOCS_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

docs: $(DOCS_STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -E -q -b html -d build/doctrees docs/reference build/docs
	@echo "API reference: build/docs/index.html"

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
