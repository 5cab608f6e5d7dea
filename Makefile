# The README's two commands: `make run` and `make test`. Everything they need is installed here.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CLAUDE_CODE_VERSION := 2.1.332
CLAUDE := .e2e/node_modules/.bin/claude
PYTEST_ARGS ?=

.PHONY: run test unit e2e bench load demo clean

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

# The Claude Code CLI for the end-to-end suite, pinned; npm is the only way in.
$(CLAUDE):
	@command -v npm >/dev/null || { echo "npm is required for the Claude Code e2e suite: install Node.js 18+ and npm" >&2; exit 1; }
	mkdir -p .e2e
	npm install --silent --no-audit --no-fund --prefix .e2e @anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION)
	$(CLAUDE) --version

run: $(VENV)/.installed
	$(PY) -m relay --config relay.yaml

test: $(VENV)/.installed $(CLAUDE)
	RELAY_CLAUDE=$(abspath $(CLAUDE)) $(PY) -m pytest $(PYTEST_ARGS)

unit: $(VENV)/.installed
	$(PY) -m pytest -m "not e2e" $(PYTEST_ARGS)

e2e: $(VENV)/.installed $(CLAUDE)
	RELAY_CLAUDE=$(abspath $(CLAUDE)) $(PY) -m pytest -m e2e $(PYTEST_ARGS)

bench: $(VENV)/.installed
	$(PY) tests/bench/run.py

# Loopback only, bounded, stops by itself (about four minutes); not part of `make test`.
load: $(VENV)/.installed
	$(PY) tests/load/run.py

demo: $(VENV)/.installed
	$(PY) -m relay.demo

clean:
	rm -rf $(VENV) .e2e .pytest_cache .hypothesis .bench .load dumps *.egg-info
