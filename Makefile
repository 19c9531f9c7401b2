# Developer entry points. `make demo` and `make test` work on a fresh machine with
# Python 3.11+, make and redis-server (tests start their own Redis servers).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-fast test-busy lint unit bench proto contract check-image clean system

# Four distributions from this tree, in one pip call so that pip takes them all from
# here: clients/ (qosd-client: the gateway's client and the qosd.v1 stubs), . (qosd:
# the daemon, and the dev tools), harness/ (qosd-harness: the tests' and benchmarks'
# process harness) and sim/ (qosd-sim: the simulator, `qosd demo`).
$(BIN)/.installed: pyproject.toml clients/pyproject.toml harness/pyproject.toml sim/pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "qosd needs Python 3.11+"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ./clients -e '.[dev]' -e ./harness -e ./sim
	touch $@

demo: $(BIN)/.installed  ## the daemon on the embedded store, with a demo workload
	$(BIN)/qosd demo

test: system lint unit  ## everything CI checks

# The system packages the tests need, installed when missing (apt-get), and helm.
system:
	scripts/system_packages.sh
	scripts/get_helm.sh

# Deterministic and quick (no Redis, no daemon processes, no sleeps): the budget
# arithmetic, the allocation, the control law, config and reload plans, the waiting
# room's order and the differential machine on the embedded store. About 20 s on 2 CPUs.
test-fast: $(BIN)/.installed
	$(BIN)/pytest -m fast -q -p no:cacheprovider

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/hadolint Dockerfile
	PATH=$(CURDIR)/$(BIN):$$PATH scripts/gen_proto.sh --check
	$(BIN)/python scripts/gen_lua_contract.py --check
	$(BIN)/python scripts/gen_openapi.py --check

# With branch coverage of qosd/, the daemons and command lines the tests start as
# processes included ([tool.coverage.*] in pyproject.toml): a summary at the end, and
# results/coverage.json. A bare `pytest` measures nothing.
# Test files are spread over TEST_WORKERS processes (pytest-xdist), whole files to a
# worker so that a file's Redis servers and cluster are started once.
TEST_WORKERS ?= 2
unit: $(BIN)/.installed
	rm -rf results/coverage
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile --cov --cov-report=term --cov-report=json

# The suite as a busy, shared CI machine runs it (docs/testing.md, "A busy machine"), to
# find the next flake before CI does: one core kept busy by a spinning process (pinned
# to CPU BUSY_CPU where taskset exists) while the whole suite runs on TEST_WORKERS
# workers in a shuffled order (files, and tests within each file: pytest-random-order,
# seeded; BUSY_SEED=N repeats an order), then the files that start servers and
# processes and time what they do, BUSY_COUNT times each test (pytest-repeat). No
# coverage. The spinner is killed at the end, also when a test fails or on Ctrl-C.
ifndef BUSY_SEED
BUSY_SEED := $(shell od -An -N2 -tu2 /dev/urandom | tr -d ' ')
endif
BUSY_CPU ?= 0
BUSY_COUNT ?= 2
BUSY_FILES ?= tests/test_daemon.py tests/test_health.py tests/test_outage.py \
	tests/test_proxy.py tests/test_proxy_commands.py tests/test_redis_sentinel.py \
	tests/test_faults.py tests/test_fleet_control.py tests/test_workers.py
BUSY_PYTEST = $(BIN)/pytest -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile \
	--random-order-bucket=module --random-order-seed=$(BUSY_SEED)
test-busy: $(BIN)/.installed
	@pin=$$(command -v taskset >/dev/null 2>&1 && echo "taskset -c $(BUSY_CPU)"); \
	$$pin python3 -c 'while True: pass' & hog=$$!; \
	trap 'kill $$hog 2>/dev/null' EXIT INT TERM; \
	echo "test-busy: a busy core (pid $$hog), shuffled with BUSY_SEED=$(BUSY_SEED)"; \
	$(BUSY_PYTEST) -q && \
	$(BUSY_PYTEST) -q --count $(BUSY_COUNT) $(BUSY_FILES)

bench: $(BIN)/.installed  ## needs h2load (apt-get install nghttp2-client)
	$(BIN)/python benchmarks/decisions.py --json results/decisions.json

check-image: $(BIN)/.installed  ## hadolint, then the Dockerfile's steps without Docker
	PATH=$(CURDIR)/$(BIN):$$PATH python3 scripts/check_docker.py

proto: $(BIN)/.installed
	PATH=$(CURDIR)/$(BIN):$$PATH scripts/gen_proto.sh

contract: $(BIN)/.installed  ## regenerate lua/_contract.lua and docs/design.md's tables
	$(BIN)/python scripts/gen_lua_contract.py

clean:
	rm -rf $(VENV) .tools .pytest_cache .mypy_cache .ruff_cache results
