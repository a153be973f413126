# ntp_opt: `make run` solves the bundled default instance, `make test` runs the tests.
# Both create the virtualenv .venv and install the package (pinned by constraints.txt).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
INSTANCE ?= instances/default.json
PAPER := instances/paper-nvl32-32k-0.1pct.json.gz instances/paper-nvl32-32k-0.4pct.json.gz \
         instances/gb200-nvl72-9k-trays.json.gz

.PHONY: install run compare figures instances test pytest lint format clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

run: install  ## solve the default instance with every policy, then the paper instances
	$(BIN)/ntp-opt solve $(INSTANCE) --planner all --time-limit 20
	$(BIN)/ntp-opt compare $(PAPER) --time-limit 20

compare: install  ## every policy on every bundled instance
	$(BIN)/ntp-opt compare $(filter-out instances/best_known.json,$(wildcard instances/*.json)) instances/*.json.gz

instances: install  ## build the large library instances (32k-131k GPUs) into instances/large/
	$(BIN)/python instances/generate.py --large

figures: install  ## regenerate the paper's results in benchmarks/paper (~20 min on 2 cores)
	$(BIN)/python benchmarks/paper/availability.py --plot
	$(BIN)/python benchmarks/paper/throughput_loss.py --plot
	$(BIN)/python benchmarks/paper/spares.py --plot

test: install lint pytest  ## lint, type-check and run the test suite

pytest: install
	$(BIN)/python -m pytest -q -n 4 --dist loadfile

lint: install
	$(BIN)/ruff check ntp_opt tests benchmarks instances
	$(BIN)/ruff format --check ntp_opt tests benchmarks instances
	$(BIN)/mypy

format: install
	$(BIN)/ruff format ntp_opt tests benchmarks instances
	$(BIN)/ruff check --fix ntp_opt tests benchmarks instances

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis build *.egg-info
