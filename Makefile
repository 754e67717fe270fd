# Two entry points: `make demo` and `make test`. Both create .venv from the pinned lock first.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
STEPS ?= 20

$(STAMP): requirements/lock.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -r requirements/lock.txt
	$(VENV)/bin/pip install --quiet --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dedloc demo --steps $(STEPS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest tests

lint: $(STAMP)
	$(VENV)/bin/ruff check dedloc_core app tests bench

.PHONY: setup demo test lint
