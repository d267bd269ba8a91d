# `make test` and `make serve` work on a fresh clone: both create .venv, install torch==2.13.0 (the CPU build) and
# the project with its dev extra, then run. torch is installed first and pinned so pip never resolves a newer one.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TORCH := torch==2.13.0

.PHONY: venv test lint serve bench bench-api clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[dev]' $(TORCH)
	touch $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check registry composites service tests bench
	$(VENV)/bin/hadolint Dockerfile

test: $(STAMP) lint
	$(PY) -m pytest

serve: $(STAMP)
	$(VENV)/bin/multicomposite serve

bench: $(STAMP)
	$(PY) -m bench

# The API under load needs wrk: `apt-get install wrk` (Debian/Ubuntu) or `brew install wrk` (macOS).
bench-api: $(STAMP)
	@command -v wrk >/dev/null || { echo "bench-api needs wrk: apt-get install wrk (or brew install wrk)"; exit 2; }
	$(PY) -m bench.api

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
