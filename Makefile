# The README's two commands: `make run` and `make test`. Everything they need is installed here.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CLAUDE_CODE_VERSION := 2.1.332
CLAUDE := .e2e/node_modules/.bin/claude
HAPROXY := /usr/sbin/haproxy
PYTEST_ARGS ?=

.PHONY: run test unit e2e bench demo clean

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

# HAProxy, for the replica tests (two relays behind a real load balancer): Debian's package.
# The test starts its own on loopback with a config it writes; the service is not used.
$(HAPROXY):
	@command -v apt-get >/dev/null || { echo "HAProxy is required for the replica tests: install it (Debian/Ubuntu: apt-get install haproxy)" >&2; exit 1; }
	@echo "installing haproxy from Debian's packages"
	@apt-get update -qq >/dev/null
	@DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends haproxy >/dev/null
	@$(HAPROXY) -v | head -1

run: $(VENV)/.installed
	$(PY) -m relay --config relay.yaml

test: $(VENV)/.installed $(CLAUDE) $(HAPROXY)
	RELAY_CLAUDE=$(abspath $(CLAUDE)) $(PY) -m pytest $(PYTEST_ARGS)

unit: $(VENV)/.installed $(HAPROXY)
	$(PY) -m pytest -m "not e2e" $(PYTEST_ARGS)

e2e: $(VENV)/.installed $(CLAUDE) $(HAPROXY)
	RELAY_CLAUDE=$(abspath $(CLAUDE)) $(PY) -m pytest -m e2e $(PYTEST_ARGS)

bench: $(VENV)/.installed
	$(PY) tests/bench/run.py

demo: $(VENV)/.installed
	$(PY) -m relay.demo

clean:
	rm -rf $(VENV) .e2e .pytest_cache .hypothesis .bench dumps *.egg-info
