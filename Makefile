# Quick start on a fresh Debian 12 host (as root): `make demo` and `make test`.
# Both install what they need first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
AGENT := src/corral/agent/corral-agent
PYTEST_ARGS ?=
# `make test` runs the suite in this many pytest processes (pytest-xdist), each test file whole in one:
# most of a test's time is waiting on sandboxes, servers and timeouts, so two halve the suite's wall
# time on two cores (831 s -> 447 s on this VM); each process has its own state directory and cgroup
# parent (tests/conftest.py). TEST_WORKERS=0 runs it in one.
TEST_WORKERS ?= 2

.PHONY: install system venv agent launcher bytecode demo test test-v2 lint typecheck bench prepare clean

install: system venv agent launcher bytecode

system:
	./scripts/install-system-packages.sh

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev,cluster]'
	touch $@

venv: $(VENV)/.installed

AGENT_SOURCES := $(addprefix src/corral/agent/,agent.c exec.c files.c guest_ops.c relay.c relay_mux.c users.c mountns.c command_groups.c owner_watch.c)

$(AGENT): $(AGENT_SOURCES) src/corral/agent/agent.h src/corral/agent/relay_mux.h
	# built beside and renamed into place: a process reading it meanwhile (agent_build.py installs
	# a copy per content hash) took a half-written binary ("Exec format error")
	cc -O2 -Wall -Wextra -static -o $@.tmp $(AGENT_SOURCES) && mv -f $@.tmp $@

agent: $(AGENT)

# `corral` itself: a C launcher in place of pip's console script (the same CLI, exec'd), which
# hands `corral run` straight to a running `corral daemon` without Python's start-up
$(VENV)/bin/corral: $(VENV)/.installed src/corral/cli/launcher.c
	cc -O2 -Wall -Wextra -DCORRAL_PYTHON='"$(abspath $(PY))"' -o $(VENV)/bin/.corral-launcher src/corral/cli/launcher.c
	mv -f $(VENV)/bin/.corral-launcher $@

launcher: $(VENV)/bin/corral

# Byte-compile up front (as a wheel install would): with PYTHONDONTWRITEBYTECODE set,
# every `corral` invocation would otherwise recompile its modules (~70 ms).
bytecode: venv
	$(PY) -m compileall -q src $(VENV)/lib > /dev/null

demo: install
	$(PY) scripts/demo.py

# ruff, mypy and the duplicate-lines check first: a lint or type error fails `make test` (and so CI) before any test runs
# The microVM tier's first-use builds (the host image's disk, ~40 s on a fresh machine, and the
# template the tests' 256M sandboxes restore) run beside lint and the other tiers' first tests
# (the conformance suite runs its microVM items last) instead of holding up the first microVM
# test; a test that needs them waits on the same cache locks, so nothing is built twice.
test: install
	@$(VENV)/bin/corral prepare --tier microvm --memory 256M > .prepare-microvm.log 2>&1 & prep=$$!; \
	  $(MAKE) --no-print-directory lint && $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS); status=$$?; \
	  wait $$prep; exit $$status

# Only the process tier on cgroup v2, inside a microVM guest (`make test` runs it too:
# tests/test_cgroup_v2_guest.py; about 1-1.5 minutes under TCG).
test-v2: install
	$(VENV)/bin/pytest -q -rP $(PYTEST_ARGS) tests/test_cgroup_v2_guest.py

lint: install
	$(VENV)/bin/ruff check src tests bench scripts
	$(VENV)/bin/mypy
	$(PY) scripts/check_duplicates.py

# every tier's first-use builds now (microVM kernel, disk and template; wasm compile), with progress
prepare: install
	$(VENV)/bin/corral prepare

bench: install
	$(PY) bench/startup.py

clean:
	rm -rf $(VENV) $(AGENT) build *.egg-info
