# Two entry points for a fresh machine: `make demo` and `make test`. `make mutate` is a developer check.
# torch is installed first and pinned, so the package's `torch>=2.4` range is
# already satisfied and installing minitrain never replaces it. Which build of
# torch arrives is up to the index: on a CPU-only Linux box pointed at PyPI, add
#   TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
# to get the CPU wheel instead of the CUDA one.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
TORCH_PIP_ARGS ?=
MUTATE_ARGS ?=
CHAOS_SEEDS ?= 1 2 3
CHAOS_ARGS ?= --faults 10 --steps 200
BENCH_ARGS ?=
BIN    := $(VENV)/bin

.PHONY: demo test mutate chaos bench install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/minitrain demo

test: install
	$(BIN)/python -m pytest -q

# Do the tests catch the bugs they exist for? Each one-line bug in tools/mutations.toml is applied alone
# to a scratch copy and its tests must fail there. Slow (minutes), so not part of `make test`;
# MUTATE_ARGS="--only ID ..." runs some, MUTATE_ARGS=--list shows them.
mutate: install
	$(BIN)/python tools/mutate.py $(MUTATE_ARGS)

# A long run under random faults of every kind, one campaign per seed (tools/chaos.py): each must end bit for bit
# where the uninterrupted run ends. The reports become the tables in docs/fault-tolerance.md. Minutes per seed.
chaos: install
	for seed in $(CHAOS_SEEDS); do \
		$(BIN)/python tools/chaos.py --seed $$seed $(CHAOS_ARGS) --json benchmarks/results/chaos_seed$$seed.json \
			|| exit 1; \
	done
	$(BIN)/python benchmarks/tables.py

# Every benchmark behind a table in README.md or docs/, rerun as its result file records, then the tables
# regenerated from the results (benchmarks/run_all.py; BENCH_ARGS="--only FILE ..." or "--list"). Slow.
bench: install
	$(BIN)/python benchmarks/run_all.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) runs build src/*.egg-info
