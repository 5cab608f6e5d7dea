"""Plugins found by name, the hook contract, and relay.yaml validation."""

from __future__ import annotations

import inspect
import itertools
import os
import re
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
import relay_builtins
import yaml
from support import ROOT, Relay, backend

from relay import config as config_module
from relay import hookspecs
from relay.chain import ENTRY_POINT_GROUP, available_plugins, load_plugins
from relay.errors import ConfigError

BUILTINS = {"dedup", "pairing", "ordering", "dump"}


def test_builtins_register_through_the_entry_point_group():
    found = available_plugins()
    assert BUILTINS <= set(found)
    for name in BUILTINS:
        assert found[name].group == ENTRY_POINT_GROUP
        assert found[name].module == f"relay_builtins.{name}"


def test_the_builtins_install_from_this_repos_plugins_directory():
    assert Path(relay_builtins.__file__).resolve().parent == ROOT / "plugins"


def test_hook_specs_are_prefixed_and_documented():
    specs = [name for name, f in inspect.getmembers(hookspecs, inspect.isfunction)
             if hasattr(f, "relay_spec")]
    assert len(specs) >= 8
    for name in specs:
        assert name.startswith("relay_")
        doc = inspect.getdoc(getattr(hookspecs, name))
        assert doc and "Called" in doc, name


def test_unknown_plugin_stops_start_up_listing_the_available_ones():
    with pytest.raises(ConfigError) as e:
        load_plugins(["dedup", "nope"])
    message = str(e.value)
    assert message.startswith("pipeline[1]: unknown plugin 'nope'")
    for name in BUILTINS:
        assert name in message


@pytest.mark.parametrize("raw,message", [
    ({}, "backends: required"),
    ({"backends": [{"name": "a", "url": "http://x"}, {"name": "b"}]}, "backends[1].url: required"),
    ({"backends": [{"url": "http://x"}]}, "backends[0].name: required"),
    ({"backends": [{"name": "a", "url": "ftp://x"}]}, "backends[0].url: must be an http"),
    ({"backends": [{"name": "a", "url": "http://x", "models": "claude-*"}]},
     "backends[0].models: must be a list"),
    ({"backends": [{"name": "a", "url": "http://x", "api_key_env": "RELAY_TEST_UNSET"}]},
     "backends[0].api_key_env: environment variable RELAY_TEST_UNSET is not set"),
    ({"backends": [{"name": "a", "url": "http://x", "api_key": "sk-literal"}]},
     "backends[0].api_key: unknown key"),
    ({"backends": [{"name": "a", "url": "http://x", "timeouts": {"read": -1}}]},
     "backends[0].timeouts.read: must be a positive number"),
    ({"backends": [{"name": "a", "url": "http://x"}, {"name": "a", "url": "http://y"}]},
     "backends[1].name: 'a' is used twice"),
    ({"server": {"port": "80"}, "backends": [{"name": "a", "url": "http://x"}]},
     "server.port: must be an integer"),
    ({"pipeline": "dedup", "backends": [{"name": "a", "url": "http://x"}]},
     "pipeline: must be a list"),
    ({"pipeline": ["dedup", "dedup"], "backends": [{"name": "a", "url": "http://x"}]},
     "pipeline[1]: 'dedup' is listed twice"),
    ({"plugins": {"dump": "x"}, "backends": [{"name": "a", "url": "http://x"}]},
     "plugins.dump: must be a mapping"),
    ({"bakends": []}, "bakends: unknown key"),
])
def test_config_errors_name_the_key_path(raw, message):
    with pytest.raises(ConfigError) as e:
        config_module.parse(raw, env={})
    assert str(e.value).startswith(message)


def test_readme_backend_example_is_valid():
    readme = (ROOT / "docs" / "configuration.md").read_text()
    example = readme.split("```yaml", 1)[1].split("```", 1)[0]
    config = config_module.parse(yaml.safe_load(example), env={
        "MOONSHOT_API_KEY": "sk-test", "RELAY_KEY_TEAM_A": "relay-key-0123456789abcdef"})
    assert config.keys[0].name == "team-a" and config.keys[0].backends == ["anthropic"]
    kimi = config.backends[1]
    assert kimi.timeouts.total is None and kimi.quirks == {
        "restore_original_ids": True, "drop_betas": ["context-management-*"],
        "tool_id_pattern": "^[a-zA-Z0-9_.:-]+$"}
    assert kimi.upstream_model("kimi-latest") == "kimi-k2-0905-preview"


def test_key_comes_from_the_environment_only():
    config = config_module.parse(
        {"backends": [{"name": "k", "url": "https://k.example/anthropic", "api_key_env": "K"}]},
        env={"K": "sk-env"})
    assert config.backends[0].api_key == "sk-env"


def test_shipped_relay_yaml_is_valid():
    config = config_module.load(str(ROOT / "relay.yaml"))
    assert config.pipeline == ["limits", "usage", "metrics", "cache", "dedup", "pairing",
                               "ordering", "portable", "dump"]
    assert config.host == "127.0.0.1"
    assert config.backend_for("claude-sonnet-4-6").name == "anthropic"
    load_plugins(config.pipeline)


@pytest.mark.parametrize("yaml_text,message", [
    ("backends:\n  - name: a\n", "backends[0].url: required"),
    ("pipeline: [dedup, nope]\nbackends:\n  - {name: a, url: 'http://x'}\n",
     "pipeline[1]: unknown plugin 'nope'"),
    ("backends: [\n", "not valid YAML"),
])
@pytest.mark.slow
def test_cli_exits_non_zero_on_config_errors(tmp_path, yaml_text, message):
    path = tmp_path / "relay.yaml"
    path.write_text(yaml_text)
    proc = subprocess.run([sys.executable, "-m", "relay", "--config", str(path)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.slow
def test_a_misspelt_server_key_stops_start_up_naming_the_closest_key(tmp_path):
    path = tmp_path / "relay.yaml"
    path.write_text("server:\n  prot: 8788\nbackends:\n  - {name: a, url: 'http://x'}\n")
    proc = subprocess.run([sys.executable, "-m", "relay", "--config", str(path)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "server.prot: unknown key (did you mean port?)" in proc.stderr


THIRD_PARTY = {
    "pyproject.toml": """
        [build-system]
        requires = ["setuptools>=64"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "relay-shout-example"
        version = "1.0"

        [project.entry-points."relay.plugins"]
        shout = "relay_shout"
        """,
    "relay_shout.py": """
        from relay.hookspecs import hookimpl

        @hookimpl
        def relay_request(exchange, options):
            exchange.response_headers["x-shout"] = options.get("word", "hey")
        """,
}


def test_third_party_distribution_is_installed_and_loaded_by_name(tmp_path, emulator):
    source = tmp_path / "src"
    source.mkdir()
    for name, text in THIRD_PARTY.items():
        (source / name).write_text(textwrap.dedent(text))
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(source)],
                   check=True, timeout=120)
    assert list(target.glob("relay_shout_example-1.0.dist-info"))
    emu = emulator()
    relay = Relay({"pipeline": ["shout"], "plugins": {"shout": {"word": "HELLO"}},
                   "backends": [backend(emu.url)]}, tmp_path, env={"PYTHONPATH": str(target)})
    try:
        request = urllib.request.Request(
            relay.url + "/v1/messages", method="POST", headers={"content-type": "application/json"},
            data=b'{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}')
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
            assert response.headers["x-shout"] == "HELLO"
    finally:
        relay.stop()


def test_relay_trace_logs_every_hook_call(monkeypatch, caplog):
    import asyncio

    from relay.chain import Chain
    from relay.hookspecs import hookimpl
    from relay.testing import exchange_for

    class Probe:
        @hookimpl
        def relay_request(self, exchange):
            return "seen"

    monkeypatch.setenv("RELAY_TRACE", "1")
    config = config_module.parse({"pipeline": ["probe"],
                                  "backends": [{"name": "a", "url": "http://x"}]})
    chain = Chain(load_plugins(config.pipeline, extra={"probe": Probe}), config)
    exchange = exchange_for({"messages": []}, backend=config.backends[0])
    with caplog.at_level("INFO", logger="relay.chain"):
        asyncio.run(chain.run("relay_request", exchange))
    assert re.search(r"trace relay_\w+ probe.relay_request -> 'seen'", caplog.text)



@pytest.mark.parametrize("names", [order for size in range(4)
                                   for order in itertools.permutations(
                                       ("exchange", "response", "options"), size)])
def test_a_hook_gets_its_arguments_by_name_in_any_order(names):
    # The chain passes the usual orders by position and builds the others by name: every
    # order an implementation may take its arguments in gets each under its own name.
    import asyncio

    from relay.chain import Chain
    from relay.hookspecs import hookimpl
    from relay.testing import exchange_for

    seen = []
    # pluggy reads the names from the function's code: a function with these parameters.
    made: dict = {}
    exec(f"def relay_response(self, {', '.join(names)}):\n"
         f"    seen.append(({''.join(name + ', ' for name in names)}))", {"seen": seen}, made)
    probe = type("Probe", (), {"relay_response": hookimpl(made["relay_response"])})
    config = config_module.parse({"pipeline": ["probe"], "plugins": {"probe": {}},
                                  "backends": [{"name": "a", "url": "http://x"}]})
    chain = Chain(load_plugins(config.pipeline, extra={"probe": probe}), config)
    exchange = exchange_for({"messages": []}, backend=config.backends[0])
    response = object()
    asyncio.run(chain.run("relay_response", exchange, response=response))
    given = {"exchange": exchange, "response": response,
             "options": chain.options_for(exchange)["probe"]}
    assert seen == [tuple(given[name] for name in names)]

@pytest.mark.parametrize("hook", ["relay_request", "relay_exchange_end", "relay_stream_events"])
@pytest.mark.parametrize("names", [("exchange", "options"), ("options", "exchange"),
                                   ("exchange",), ("options",), ()])
def test_the_hooks_called_directly_get_their_arguments_in_any_order(hook, names):
    # A request's, an exchange's end and a stream plan's hooks are called directly when
    # they take (exchange, options) or (exchange), by name otherwise; an async one is awaited.
    import asyncio

    from relay.chain import Chain
    from relay.hookspecs import hookimpl
    from relay.testing import exchange_for

    seen = []
    made: dict = {}
    exec(f"async def {hook}(self, {', '.join(names)}):\n"
         f"    seen.append(({''.join(name + ', ' for name in names)}))", {"seen": seen}, made)
    probe = type("Probe", (), {hook: hookimpl(made[hook])})
    config = config_module.parse({"pipeline": ["probe"], "plugins": {"probe": {}},
                                  "backends": [{"name": "a", "url": "http://x"}]})
    chain = Chain(load_plugins(config.pipeline, extra={"probe": probe}), config)
    exchange = exchange_for({"messages": []}, backend=config.backends[0])
    if hook == "relay_request":
        asyncio.run(chain.run(hook, exchange))
    elif hook == "relay_exchange_end":
        asyncio.run(chain.end(exchange))
    else:
        asyncio.run(chain.stream_plan(exchange))
    given = {"exchange": exchange, "options": chain.options_for(exchange)["probe"]}
    assert seen == [tuple(given[name] for name in names)]


@pytest.mark.parametrize("marker", [{"wrapper": True}, {"hookwrapper": True}])
def test_a_hook_wrapper_stops_start_up_naming_it(marker):
    # The chain calls each implementation itself: a wrapper's generator would be made and
    # never run, the plugin's code skipped without a word.
    from relay.hookspecs import hookimpl

    class Probe:
        @hookimpl(**marker)
        def relay_request(self, exchange):
            yield

    with pytest.raises(ConfigError, match=r"pipeline\[0\]: plugin 'probe': relay_request is a "
                                          r"hook wrapper"):
        load_plugins(["probe"], extra={"probe": Probe})


@pytest.mark.slow
def test_another_distribution_with_a_plugins_package_collides_with_nothing(tmp_path):
    """A second distribution that ships a top-level ``plugins`` package, installed beside the
    relay: both work, each finds its own."""
    source = tmp_path / "other"
    (source / "plugins").mkdir(parents=True)
    (source / "plugins" / "__init__.py").write_text("OWNER = 'other'\n")
    (source / "plugins" / "dedup.py").write_text("raise ImportError('not the relay')\n")
    (source / "pyproject.toml").write_text(textwrap.dedent("""\
        [build-system]
        requires = ["setuptools>=64"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "other-with-plugins"
        version = "1.0"
        [tool.setuptools]
        packages = ["plugins"]
        """))
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(source)],
                   check=True, capture_output=True, timeout=120)
    config = tmp_path / "relay.yaml"
    config.write_text("pipeline: [dedup, pairing, ordering]\n"
                      "backends:\n  - {name: a, url: 'http://127.0.0.1:9'}\n")
    history = tmp_path / "history.json"
    history.write_text('[{"role": "user", "content": "hi"}]')
    env = {**os.environ, "PYTHONPATH": str(target)}
    proc = subprocess.run([sys.executable, "-m", "relay", "validate", str(history),
                           "--config", str(config)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    other = subprocess.run([sys.executable, "-c", "import plugins; print(plugins.OWNER)"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert other.stdout.strip() == "other"


@pytest.mark.parametrize("access_log", [False, True])
def test_access_log_is_one_line_per_exchange_when_asked_for(tmp_path, emulator, access_log):
    emu = emulator()
    relay = Relay({"server": {"access_log": access_log}, "backends": [backend(emu.url)]},
                  tmp_path)
    try:
        request = urllib.request.Request(
            relay.url + "/v1/messages", method="POST", headers={"content-type": "application/json"},
            data=b'{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}')
        with urllib.request.urlopen(request, timeout=10) as response:
            request_id = response.headers["x-relay-request-id"]
        assert relay.wait_for_output(f"{request_id} messages", timeout=2) is access_log
    finally:
        relay.stop()
