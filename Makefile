# The README's two commands: `make run` and `make test`. Everything they need is installed here.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CLAUDE_CODE_VERSION := 2.1.332
CLAUDE := .e2e/node_modules/.bin/claude
# The JavaScript clients tests/js/ drives, pinned. ai 6 is the newest major that runs on
# Node.js 18 and 20 (ai 7 asks for 22); zod is the peer both ai and the TypeScript SDK need.
JS_CLIENTS := ai@6.0.325 @ai-sdk/anthropic@3.0.140 @anthropic-ai/sdk@1.14.0 zod@4.6.7
# Named after the pins, so that changing one installs again.
JS_CLIENTS_STAMP := .e2e/.js-clients-$(shell echo '$(JS_CLIENTS)' | cksum | cut -d' ' -f1)
HAPROXY := /usr/sbin/haproxy
# Debian's Chromium and its driver, for the console's browser tests (Selenium drives them),
# and axe-core, the accessibility checker those tests run on each page, pinned.
CHROMEDRIVER := /usr/bin/chromedriver
AXE_CORE_VERSION := 4.14.1
AXE := .axe/node_modules/axe-core/axe.min.js
REDIS := /usr/bin/redis-server
TINYPROXY := /usr/bin/tinyproxy
OPENSSL := /usr/bin/openssl
PYTEST_ARGS ?=
# The tiers (setup.cfg's markers): the fast one starts no process (tests/conftest.py refuses
# it) and is what `make check` runs, in two pytest-xdist workers (one a core; PYTEST_ARGS="-n 0
# --pdb" to debug in one process); the rest is what only `make test` adds.
FAST_TIER := -m "not e2e and not slow" -n 2
# The slow tier in two pytest-xdist workers: its tests start processes and wait on them, one
# core at a time; each has its own ports (0) and tmp_path, so two run side by side.
SLOW_TIER := -m "e2e or slow" -n 2
LINTED := relay plugins examples/plugin-package

.PHONY: run try check test test-example test-min unit e2e bench load demo docs clean

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,docs,dev]'
	touch $@

# The Claude Code CLI for the end-to-end suite, pinned; npm is the only way in.
$(CLAUDE):
	@command -v npm >/dev/null || { echo "npm is required for the Claude Code e2e suite: install Node.js 18+ and npm" >&2; exit 1; }
	mkdir -p .e2e
	npm install --silent --no-audit --no-fund --prefix .e2e @anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION)
	$(CLAUDE) --version

# After the CLI (order only): two npm installs into one prefix at once would trip on each other.
$(JS_CLIENTS_STAMP): | $(CLAUDE)
	npm install --silent --no-audit --no-fund --save-exact --prefix .e2e $(JS_CLIENTS)
	touch $@

# HAProxy, for the replica tests (two relays behind a real load balancer): Debian's package.
# The test starts its own on loopback with a config it writes; the service is not used.
$(HAPROXY):
	@command -v apt-get >/dev/null || { echo "HAProxy is required for the replica tests: install it (Debian/Ubuntu: apt-get install haproxy)" >&2; exit 1; }
	@echo "installing haproxy from Debian's packages"
	@apt-get update -qq >/dev/null
	@DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends haproxy >/dev/null
	@$(HAPROXY) -v | head -1

# Chromium and chromedriver for the console's browser tests: Debian's packages, the same
# build, so that the driver always matches the browser (tests/test_console_browser.py).
$(CHROMEDRIVER):
	@command -v apt-get >/dev/null || { echo "Chromium is required for the console's browser tests: install it (Debian/Ubuntu: apt-get install chromium chromium-driver)" >&2; exit 1; }
	@echo "installing chromium and chromium-driver from Debian's packages"
	@apt-get update -qq >/dev/null
	@DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
	@$(CHROMEDRIVER) --version | head -1

# In a prefix of its own: .e2e is the Claude Code install's.
$(AXE):
	@command -v npm >/dev/null || { echo "npm is required for the console's accessibility check: install Node.js 18+ and npm" >&2; exit 1; }
	mkdir -p .axe
	npm install --silent --no-audit --no-fund --save-exact --prefix .axe axe-core@$(AXE_CORE_VERSION)

# redis-server, for the shared state's tests (each starts its own on loopback): Debian's package.
$(REDIS):
	@command -v apt-get >/dev/null || { echo "redis-server is required for the shared-state tests: install it (Debian/Ubuntu: apt-get install redis-server)" >&2; exit 1; }
	@echo "installing redis-server from Debian's packages"
	@apt-get update -qq >/dev/null
	@DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null
	@$(REDIS) --version

# tinyproxy, for the egress proxy tests (backends reached through an HTTP proxy): Debian's
# package. Each test starts its own on loopback with a config it writes; the service is not used.
$(TINYPROXY):
	@command -v apt-get >/dev/null || { echo "tinyproxy is required for the egress proxy tests: install it (Debian/Ubuntu: apt-get install tinyproxy)" >&2; exit 1; }
	@echo "installing tinyproxy from Debian's packages"
	@apt-get update -qq >/dev/null
	@DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends tinyproxy-bin >/dev/null
	@$(TINYPROXY) -v | head -1

# openssl, for the TLS test of the upstream client (it makes a CA and certificates of its
# own in a temporary directory): Debian's package.
$(OPENSSL):
	@command -v apt-get >/dev/null || { echo "openssl is required for the upstream TLS test: install it (Debian/Ubuntu: apt-get install openssl)" >&2; exit 1; }
	@echo "installing openssl from Debian's packages"
	@apt-get update -qq >/dev/null
	@DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openssl >/dev/null
	@$(OPENSSL) version

run: $(VENV)/.installed
	$(PY) -m relay --config relay.yaml

# The relay in front of the emulator (no key, no network): see examples/try.yaml.
try: $(VENV)/.installed
	@$(PY) -m relay emulate --port 8788 --tool-turns 3 --reuse-ids & emulator=$$!; \
	trap 'kill $$emulator 2>/dev/null' EXIT INT TERM; \
	echo "try: ANTHROPIC_BASE_URL=http://127.0.0.1:8787 ANTHROPIC_API_KEY=any claude"; \
	$(PY) -m relay --config examples/try.yaml

# Lint, types and the fast tests: the loop to run before each commit, about two minutes.
# .pre-commit-config.yaml runs the same three.
check: $(VENV)/.installed
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/mypy
	$(PY) -m pytest -q $(FAST_TIER) $(PYTEST_ARGS)

# `make check` first; then the tiers it leaves out, so no test runs twice.
test: $(VENV)/.installed check $(CLAUDE) $(JS_CLIENTS_STAMP) $(HAPROXY) $(REDIS) $(CHROMEDRIVER) $(AXE)
	RELAY_CLAUDE=$(abspath $(CLAUDE)) $(PY) -m pytest $(SLOW_TIER) $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-example test-min docs

# The example plugin package, installed as its own distribution and tested with relay.testing.
test-example: $(VENV)/.installed
	$(PY) -m pip install --quiet --no-deps -e examples/plugin-package
	cd examples/plugin-package && $(abspath $(PY)) -m pytest -q -p no:cacheprovider tests

# The core suites again at the oldest versions setup.cfg accepts (its floors: a test holds
# MIN_PINS and the floors equal), so that a floor cannot silently fall out of date. aiohttp
# 3.14.4 is the first to time out a connection that never completes its headers; orjson
# before 3.9.15 accepted JSON nested past its limit.
MIN_VENV := .venv-min
MIN_PINS := aiohttp==3.14.4 aiohappyeyeballs==2.5.0 pluggy==1.3.0 orjson==3.9.15 msgspec==0.18.0 pyyaml==6.0.1 prometheus-client==0.20.0
$(MIN_VENV)/.installed: setup.cfg pyproject.toml Makefile
	test -x $(MIN_VENV)/bin/python || $(PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install --quiet $(MIN_PINS) pytest pytest-aiohttp hypothesis
	$(MIN_VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $@

test-min: $(MIN_VENV)/.installed
	$(MIN_VENV)/bin/python -m pytest -q -m "not e2e" -p no:cacheprovider tests/test_server.py \
		tests/test_security.py tests/test_upstream.py tests/test_hooks.py tests/test_skeleton.py \
		tests/test_sse.py tests/test_options.py

unit: $(VENV)/.installed $(HAPROXY) $(REDIS) $(CHROMEDRIVER) $(AXE)
	$(PY) -m pytest -m "not e2e" $(PYTEST_ARGS)

e2e: $(VENV)/.installed $(CLAUDE) $(JS_CLIENTS_STAMP) $(HAPROXY) $(REDIS)
	RELAY_CLAUDE=$(abspath $(CLAUDE)) $(PY) -m pytest -m e2e $(PYTEST_ARGS)

bench: $(VENV)/.installed
	$(PY) tests/bench/run.py

# Loopback only, bounded, stops by itself (about 37 minutes: the soak over SQLite, then over
# Redis); not part of `make test`.
load: $(VENV)/.installed $(REDIS)
	$(PY) tests/load/run.py
	$(PY) tests/load/run.py --only soak --state redis --out-dir .load/redis

# The docs site (mkdocs.yml), built strictly: a broken link or a generated part that fails
# stops the build. Into .site/, never committed. Not --quiet: it silences the warnings
# before --strict can count them, and a broken link then passes.
docs: $(VENV)/.installed
	$(PY) -m mkdocs build --strict

demo: $(VENV)/.installed
	$(PY) -m relay.demo

PROMETHEUS := /usr/bin/prometheus
# Prometheus, for the Grafana dashboard's test (every query run against a real scrape of a
# relay): Debian's package. The test starts its own on loopback; the service is not used.
$(PROMETHEUS):
	@command -v apt-get >/dev/null || { echo "Prometheus is required for the dashboard test: install it (Debian/Ubuntu: apt-get install prometheus)" >&2; exit 1; }
	@echo "installing prometheus from Debian's packages"
	@apt-get update -qq >/dev/null
	@DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
	@$(PROMETHEUS) --version | head -1

test unit: $(PROMETHEUS)
test unit: $(TINYPROXY)
test unit: $(OPENSSL)

# Never dumps: they are an operator's record of failures, not build output.
clean:
	rm -rf $(VENV) $(MIN_VENV) .e2e .axe .pytest_cache .mypy_cache .ruff_cache .hypothesis .bench .load .site *.egg-info
