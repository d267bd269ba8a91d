# `make test` and `make serve` work on a fresh clone: both create .venv, install torch==2.13.0 (the CPU build) and
# the project with its dev extra (every other extra, and the test and lint tools), then run. torch is installed first
# and pinned so pip never resolves a newer one.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TORCH := torch==2.13.0

.PHONY: venv test test-all lint serve bench bench-api clean browser-deps postgres-deps kernel-deps kernels container-smoke

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[dev]' $(TORCH)
	touch $(STAMP)

# The layer contracts (.importlinter: layers, independence, forbidden imports, no cycles) and no private name imported
# across packages (ruff's PLC2701): a change that imports against the layers fails here. docs/layout.md describes both.
lint: $(STAMP)
	$(PY) -m ruff check registry composites service tests bench
	$(VENV)/bin/lint-imports
	$(VENV)/bin/hadolint Dockerfile containers/postgres/Containerfile

# The dashboard's browser test drives Debian's chromium through chromium-driver (Selenium). As root, make installs
# them; otherwise it says how, and that test skips. As root a missing browser then fails the test instead.
BROWSER := /usr/bin/chromium /usr/bin/chromedriver
AS_ROOT := $(shell [ "$$(id -u)" = 0 ] && echo 1 || echo 0)

browser-deps:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif [ "$(AS_ROOT)" = 1 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium and chromium-driver for the dashboard's browser test"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			chromium chromium-driver fonts-dejavu-core >/dev/null; \
	else \
		echo "note: the dashboard's browser test needs $(BROWSER) and skips without them;" \
			"install them with: sudo apt-get install chromium chromium-driver fonts-dejavu-core"; \
	fi

# The PostgreSQL store's tests start a throwaway server (tests/pgserver.py) from Debian's postgresql package. As root,
# make installs it; otherwise it says how, and those tests skip. As root a missing server then fails them instead.
postgres-deps:
	@if ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || [ -n "$$POSTGRES_BIN_DIR" ]; then :; \
	elif [ "$(AS_ROOT)" = 1 ] && command -v apt-get >/dev/null; then \
		echo "installing postgresql for the PostgreSQL store's tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			postgresql >/dev/null; \
	else \
		echo "note: the PostgreSQL store's tests need PostgreSQL's server binaries and skip without them;" \
			"install them with: sudo apt-get install postgresql (or set POSTGRES_BIN_DIR to their folder)"; \
	fi

# use()'s C++ routing kernels need a C++ compiler and functorch's headers, which include <nlohmann/json.hpp> (not in
# the torch wheel). As root, make installs g++ and nlohmann-json3-dev; otherwise it says how, use() runs its Python
# kernels, and the C++ half of the routing tests skips. As root a failed build then fails those tests instead.
kernel-deps:
	@if command -v c++ >/dev/null && [ -f /usr/include/nlohmann/json.hpp ]; then :; \
	elif [ "$(AS_ROOT)" = 1 ] && command -v apt-get >/dev/null; then \
		echo "installing g++ and nlohmann-json3-dev for the C++ routing kernels"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			g++ nlohmann-json3-dev >/dev/null; \
	else \
		echo "note: the C++ routing kernels need a C++ compiler and nlohmann-json; without them use() runs its" \
			"Python kernels; install them with: sudo apt-get install g++ nlohmann-json3-dev"; \
	fi

# Compiled once per torch, Python and flags into ~/.cache/multicomposite/kernels (about a minute on two cores).
kernels: $(STAMP) kernel-deps
	@$(VENV)/bin/multicomposite build-kernels || [ "$(AS_ROOT)" = 0 ]

# The suite on TEST_WORKERS workers, one per core by default: every test file on one worker (pytest-xdist; a file's
# module fixtures are made once), then the tests marked serial alone (they time code, or load the cores on purpose).
# On two cores (from a fresh clone) that took 6 min 19 s for the parallel part and 43 s for the serial one. TEST_WORKERS=0: one
# process. test-all: every case of the sampled tests too (MULTICOMPOSITE_TEST_ALL=1,
# tests/cases.py: the conformance tests on every sample of every covered op, compile around grad, jvp and two
# transforms in the verify and routing matrices), which the docs' conformance figures are measured with; longer than
# CI allows.
TEST_WORKERS ?= auto
# Every test marked serial lives here (tests/conftest.py refuses one elsewhere).
SERIAL_TESTS = tests/registry/profiling
TEST_ENV = DASHBOARD_TEST_REQUIRE_BROWSER=$(AS_ROOT) POSTGRES_TEST_REQUIRE_SERVER=$(AS_ROOT) \
	ROUTING_TEST_REQUIRE_CPP=$(AS_ROOT)
ifeq ($(TEST_WORKERS),0)
PYTEST_RUN = $(PY) -m pytest
else
PYTEST_RUN = $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not serial" && $(PY) -m pytest -m serial $(SERIAL_TESTS)
endif

test: $(STAMP) lint browser-deps postgres-deps kernels
	$(TEST_ENV) sh -c '$(PYTEST_RUN)'

test-all: $(STAMP) lint browser-deps postgres-deps kernels
	$(TEST_ENV) MULTICOMPOSITE_TEST_ALL=1 sh -c '$(PYTEST_RUN)'

serve: $(STAMP)
	$(VENV)/bin/multicomposite serve

bench: $(STAMP)
	$(PY) -m bench

# The API under load needs wrk: `apt-get install wrk` (Debian/Ubuntu) or `brew install wrk` (macOS).
bench-api: $(STAMP)
	@command -v wrk >/dev/null || { echo "bench-api needs wrk: apt-get install wrk (or brew install wrk)"; exit 2; }
	$(PY) -m bench.api

# compose.yaml's stack end to end with podman: build, up, /readyz, the dashboard, a verify job on the worker, down.
# Minutes, and needs podman (installed when run as root on Debian), so not part of `make test`. README: "Compose".
container-smoke:
	bash scripts/container-smoke.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info test-output
