# Two entry points: `make demo` and `make test` (`make test-fast` for the development loop). Both create .venv from the pinned lock first.
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

# The development loop's tier (a few minutes on 2 cores): no workers, swarms, desktops or network
# labs (the tests marked slow). CI runs everything (`make test`).
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -m "not slow and not installer" tests

# The Linux packages (dist/dedloc/dedloc, the .deb and the .tar.gz); see installers/README.md.
bundle: $(STAMP)
	PYTHON=$(VENV)/bin/python bash installers/build_linux.sh

# Builds the packages once and checks them (bundle self-test, .deb contents, launcher); a few minutes.
installer-test: $(STAMP)
	$(VENV)/bin/python -m pytest -m installer -s tests/test_installer.py

lint: $(STAMP)
	$(VENV)/bin/ruff check dedloc_core app tests bench

.PHONY: setup demo test test-fast lint bundle installer-test
