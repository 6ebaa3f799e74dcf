# The two commands a newcomer types: `make run` and `make test`. Both build the virtual
# environment they need first (Python 3.11, the CPU build of torch 2.13.0).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: run test install system-deps lint bench clean

$(VENV)/.installed: pyproject.toml setup.py manager/_native.c
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

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

test: install system-deps lint
	$(VENV)/bin/pytest -q

bench: install
	$(PY) bench/hotpath.py --peers

clean:
	rm -rf $(VENV) .kvtier .pytest_cache .hypothesis
