# One entry point per thing a person does. Every target installs what it needs.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
CONFIG  ?= configs/default.yaml
ARGS    ?=
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: run test test-fast ui serve install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/sftflow run -c $(CONFIG) $(ARGS)

# The full suite (CI): torchrun, the Prefect and MLflow servers, the whole flow.
test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

# The fast tier while you work: in-process, no torchrun, no servers (under 2 minutes).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

ui: $(STAMP)
	$(BIN)/mlflow ui --host 127.0.0.1 --port 5000 \
	  --backend-store-uri sqlite:///$(CURDIR)/artifacts/mlflow.db \
	  --default-artifact-root $(CURDIR)/artifacts/mlartifacts

# Retrain on a schedule: a local Prefect server (UI at http://127.0.0.1:4200, home under
# artifacts/) plus a process serving the flow with CRON. Ctrl-C stops both.
CRON    ?= 0 3 * * *
serve: $(STAMP)
	$(BIN)/sftflow serve -c $(CONFIG) --cron "$(CRON)" --start-server $(ARGS)

clean:
	rm -rf artifacts/prepare artifacts/train artifacts/evaluate artifacts/register artifacts/models
