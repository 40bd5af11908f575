# Two entry points: `make demo` (restart-and-resume demo on the embedded LMDB store) and
# `make test` (the whole test suite; .ci/run calls it). Both set up .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test setup redis-server bench

demo: setup
	$(BIN)/tiered-kv demo restart

test: setup redis-server
	$(BIN)/python -m pytest -q

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0   # the CPU wheel; a bare `torch` pulls a multi-GB CUDA build
	$(BIN)/pip install -q -e '.[dev,triton]'
	touch $(STAMP)

# tests start their own redis-servers on free loopback ports (a 3+3 cluster too, formed with
# redis-cli); install both when missing
redis-server:
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null || { \
	  echo "installing redis-server from Debian's packages"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null; }

bench: setup redis-server
	$(BIN)/python tools/bench_tiers.py
