# One entry point per thing a person does. Every target installs what it needs.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
CONFIG  ?= configs/default.yaml
ARGS    ?=
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: run test test-fast test-min-versions lint ui prefect-ui serve-model serve team-up team-down install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/sftflow run -c $(CONFIG) $(ARGS)

# The full suite (CI): the linter, then torchrun, the Prefect and MLflow servers, the whole flow.
# Two workers, a test file each at a time (module fixtures stay in one process): much of the suite waits on
# servers, subprocess starts and torchrun rendezvous, which the other worker's tests fill. The longest
# files go first (tests/conftest.py LONG_FILES), in that order.
TEST_WORKERS ?= 2
test: lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(ARGS)

# The fast tier while you work: in-process, no torchrun, no servers (under 2 minutes).
test-fast: lint
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

# The oldest versions pyproject.toml admits: tests/min_versions.py pins each direct dependency at its lower
# bound (a pip constraints file), installed in a fresh venv of its own (everything else at its newest that
# fits, as a user would get); then the fast tier, and the generation, loss and GGUF export files whole (their
# slow tests too). ~10 min on 2 cores (install ~1.5 with pip's cache warm, fast tier ~7.5); the main venv has
# the newest versions.
VENV_MIN ?= .venv-min
MIN_FILES := tests/test_generation_exact.py tests/test_loss.py tests/test_export_gguf.py
test-min-versions:
	rm -rf $(VENV_MIN)
	$(PY) -m venv $(VENV_MIN)
	$(VENV_MIN)/bin/pip install -q --upgrade pip
	$(VENV_MIN)/bin/python tests/min_versions.py --constraints $(VENV_MIN)/constraints.txt
	timeout 900 $(VENV_MIN)/bin/pip install -q -c $(VENV_MIN)/constraints.txt -e '.[dev]'
	$(VENV_MIN)/bin/python tests/min_versions.py --check $(VENV_MIN)/constraints.txt
	timeout 1500 $(VENV_MIN)/bin/python -m pytest -q -p no:cacheprovider -m "not slow" $(ARGS)
	timeout 600 $(VENV_MIN)/bin/python -m pytest -q -p no:cacheprovider -m slow $(MIN_FILES) $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check stages flows tests bench data

# The MLflow UI over the config's tracking store; prints the page of its experiment's runs (MLflow 3
# opens an experiment on its GenAI overview otherwise), or says nothing was logged there yet.
UI_PORT ?= 5000
ui: $(STAMP)
	@$(BIN)/python -m stages.tracking.ui $(CONFIG) --port $(UI_PORT)

# The Prefect UI over the config's past flow runs (the kept server, held until Ctrl-C); schedules nothing.
prefect-ui: $(STAMP)
	$(BIN)/sftflow ui -c $(CONFIG)

# A registered model over REST on 127.0.0.1:PORT (POST /invocations). MLflow starts uvicorn by
# name, so the venv's bin goes first on PATH.
MLFLOW_DB ?= $(CURDIR)/artifacts/mlflow.db
MODEL ?= models:/tiny-chat-sft@champion
PORT  ?= 5001
serve-model: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" MLFLOW_TRACKING_URI=sqlite:///$(MLFLOW_DB) \
	  $(BIN)/mlflow models serve -m $(MODEL) --env-manager local --host 127.0.0.1 --port $(PORT)

# Retrain on a schedule: a local Prefect server (UI at http://127.0.0.1:4200, home under
# artifacts/) plus a process serving the flow with CRON. Ctrl-C stops both.
CRON    ?= 0 3 * * *
serve: $(STAMP)
	$(BIN)/sftflow serve -c $(CONFIG) --cron "$(CRON)" --start-server $(ARGS)

# A team's setup on this machine (docs/operations.md, "For a team"): PostgreSQL holding Prefect's and MLflow's
# stores, both servers, work pool POOL and WORKERS workers, everything under TEAM_ROOT; team-down stops it all.
TEAM_ROOT ?= $(CURDIR)/artifacts/team
WORKERS   ?= 2
POOL      ?= team
team-up: $(STAMP)
	$(BIN)/python -m flows.servers.team up --root $(TEAM_ROOT) --workers $(WORKERS) --pool $(POOL) --config $(CONFIG)

team-down: $(STAMP)
	$(BIN)/python -m flows.servers.team down --root $(TEAM_ROOT)

clean:
	rm -rf artifacts/prepare artifacts/train artifacts/evaluate artifacts/register artifacts/models
