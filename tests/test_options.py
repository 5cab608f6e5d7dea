"""Declared options, the plugins' and the host's own: checked at start-up, each plugin sees its
own (the docs' tables are the declarations)."""

from __future__ import annotations

import argparse
import importlib.util

import pytest
import yaml
from support import ROOT, backend

from relay import config as config_module
from relay.chain import Chain, load_plugins
from relay.cli import add_serve_arguments
from relay.errors import ConfigError
from relay.hookspecs import hookimpl
from relay.options import Option


def chain_for(pipeline, plugins=None, quirks=None, extra=None):
    config = config_module.parse({"pipeline": list(pipeline), "plugins": plugins or {},
                                  "backends": [backend("http://127.0.0.1:1", name="a"),
                                               backend("http://127.0.0.1:1", name="b",
                                                       quirks=quirks or {})]})
    return Chain(load_plugins(list(pipeline), extra=extra), config)


@pytest.mark.parametrize("pipeline,plugins,quirks,message", [
    (["dedup"], {"dedup": {"dedup_seperator": "_"}}, None,
     r"^plugins\.dedup\.dedup_seperator: unknown option \(did you mean dedup_separator\?\)"),
    (["dedup"], None, {"dedup_seperator": "_"},
     r"^backends\[1\]\.quirks\.dedup_seperator: unknown quirk \(did you mean dedup_separator\?\)"),
    (["dedup"], {"dedup": {"dedup_tool_ids": "yes"}}, None,
     r"^plugins\.dedup\.dedup_tool_ids: must be true or false, not 'yes'"),
    (["dedup"], None, {"dedup_separator": "-1"},
     r"^backends\[1\]\.quirks\.dedup_separator: must be a non-empty string without digits"),
    (["dump"], {"dump": {"dir": "d", "max_files": 0}}, None,
     r"^plugins\.dump\.max_files: must be a positive integer"),
    (["ordering"], {"ordering": {"ordering_mode": "maybe"}}, None,
     r"^plugins\.ordering\.ordering_mode: must be one of reject, repair, off, not 'maybe'"),
    (["ordering"], None, {"ordering_mode": "sort"}, r"^backends\[1\]\.quirks\.ordering_mode: "),
    (["pairing"], {"pairing": {"mode": "repair"}}, None,
     r"^plugins\.pairing\.mode: unknown option \(did you mean pairing_mode\?\)"),
    (["pairing"], None, {"pairing_mod": "repair"},
     r"^backends\[1\]\.quirks\.pairing_mod: unknown quirk \(did you mean pairing_mode\?\)"),
    (["pairing"], None, {"merge_consecutive": "no"},
     r"^backends\[1\]\.quirks\.merge_consecutive: must be true or false"),
    (["metrics"], {"metrics": {"pth": "/m"}}, None,
     r"^plugins\.metrics\.pth: unknown option \(did you mean path\?\)"),
    (["metrics"], {"metrics": {"path": "metrics"}}, None,
     r"^plugins\.metrics\.path: must be a path starting with '/'"),
])
def test_mistakes_are_named_with_their_key_path(pipeline, plugins, quirks, message):
    with pytest.raises(ConfigError, match=message):
        chain_for(pipeline, plugins, quirks)


def test_a_quirk_the_host_reads_is_not_a_mistake():
    config = config_module.parse({"pipeline": ["dedup"], "backends": [backend(
        "http://127.0.0.1:1", format="openai", quirks={"max_tokens_field": "max_tokens"})]})
    chain = Chain(load_plugins(["dedup"]), config)
    assert "max_tokens_field" not in chain.options[config.backends[0].name]["dedup"]


def test_a_quirk_of_a_plugin_outside_the_pipeline_is_not_a_mistake():
    chain = chain_for(["metrics"], quirks={"restore_original_ids": True})
    assert chain.options["b"]["metrics"] == {"path": "/metrics", "scrape_key_env": ""}


def test_a_plugin_sees_its_own_options_with_defaults_and_its_own_quirks_only():
    class Quiet:
        OPTIONS = (Option("level", int, 1, "how quiet", quirk=True),
                   Option("name", str, "q", "what to call it"))

        @hookimpl
        def relay_request(self, exchange):
            pass

    chain = chain_for(["dedup", "quiet"], plugins={"quiet": {"name": "z"}},
                      quirks={"level": 3, "restore_original_ids": True},
                      extra={"quiet": Quiet()})
    assert chain.options[None]["quiet"] == {"level": 1, "name": "z"}
    assert chain.options["b"]["quiet"] == {"level": 3, "name": "z"}
    assert chain.options["b"]["dedup"] == {"dedup_tool_ids": True, "restore_original_ids": True,
                                           "dedup_separator": "-"}


def test_a_plugin_that_declares_nothing_gets_everything_unchecked():
    class Old:
        @hookimpl
        def relay_request(self, exchange):
            pass
    chain = chain_for(["old"], plugins={"old": {"anything": 1}}, quirks={"whatever": 2},
                      extra={"old": Old()})
    assert chain.options["b"]["old"] == {"anything": 1, "whatever": 2}


def test_a_required_option_missing_is_an_error():
    class Needy:
        OPTIONS = (Option("level", int, None, "how needy", required=True),)

        @hookimpl
        def relay_request(self, exchange):
            pass

    with pytest.raises(ConfigError, match=r"^plugins\.needy\.level: required$"):
        chain_for(["needy"], extra={"needy": Needy()})
    with pytest.raises(ConfigError, match=r"^plugins\.needy\.level: must be an integer, not None"):
        chain_for(["needy"], plugins={"needy": {"level": None}}, extra={"needy": Needy()})
    chain = chain_for(["needy"], plugins={"needy": {"level": 2}}, extra={"needy": Needy()})
    assert chain.options[None]["needy"] == {"level": 2}


def test_a_number_option_checks_an_integer_too():
    option = Option("wait", float, 1.0, "seconds", check=lambda v: None if v > 0 else "too short")
    assert option.validate(2, "p.wait") == 2 and option.validate(0.5, "p.wait") == 0.5
    with pytest.raises(ConfigError, match=r"^p\.wait: too short$"):
        option.validate(0, "p.wait")
    with pytest.raises(ConfigError, match=r"^p\.wait: must be a number, not True$"):
        option.validate(True, "p.wait")


# --- the host's own keys, declared the same way -------------------------------------------

MINIMAL = {"backends": [backend("http://127.0.0.1:1")]}
ENV = {"KEY_A": "relay-key-0123456789abcdef"}


@pytest.mark.parametrize("server,message", [
    ({"prot": 8788}, "server.prot: unknown key (did you mean port?)"),
    ({"max_body_byte": 10}, "server.max_body_byte: unknown key (did you mean max_body_bytes?)"),
    ({"stream_keep_alive": 5}, "server.stream_keep_alive: unknown key "
                               "(did you mean stream_keepalive?)"),
    ({"auth": {"kyes": []}}, "server.auth.kyes: unknown key (did you mean keys?)"),
    ({"auth": {"keys": [{"name": "a", "key_evn": "KEY_A"}]}},
     "server.auth.keys[0].key_evn: unknown key (did you mean key_env?)"),
    ({"auth": {"keys": [{"key_env": "KEY_A"}]}}, "server.auth.keys[0].name: required"),
])
def test_a_misspelt_server_key_names_its_path_and_the_closest_key(server, message):
    with pytest.raises(ConfigError) as error:
        config_module.parse({**MINIMAL, "server": server}, ENV)
    assert str(error.value) == message


@pytest.mark.parametrize("entry,message", [
    ({"modles": ["x"]}, "backends[0].modles: unknown key (did you mean models?)"),
    ({"api_key": "sk-literal"}, "backends[0].api_key: unknown key (did you mean api_key_env?)"),
    ({"timeouts": {"conect": 5}}, "backends[0].timeouts.conect: unknown key "
                                  "(did you mean connect?)"),
    ({"retries": {"attemps": 3}}, "backends[0].retries.attemps: unknown key "
                                  "(did you mean attempts?)"),
    ({"retries": {"attempts": 11}}, "backends[0].retries.attempts: must be between 1 and 10"),
    ({"retries": {"statuses": [404]}},
     "backends[0].retries.statuses[0]: only 429 and 5xx answers are retried"),
    ({"timeouts": {"total": "long"}}, "backends[0].timeouts.total: must be a positive number"),
])
def test_a_misspelt_backend_key_names_its_path_and_the_closest_key(entry, message):
    with pytest.raises(ConfigError) as error:
        config_module.parse({"backends": [backend("http://127.0.0.1:1", **entry)]})
    assert str(error.value) == message


def test_a_backend_without_its_keys_takes_the_declared_defaults():
    parsed = config_module.parse({"backends": [{"name": "a", "url": "http://127.0.0.1:1"}]})
    found = parsed.backends[0]
    for option in config_module.BACKEND_OPTIONS:
        if option.name in ("timeouts", "retries", "auth", "holds_threads", "holds_diagnostics",
                           "name", "url", "pool"):
            continue
        assert getattr(found, option.name) == option.default, option.name
    assert found.auth == "x-api-key" and found.holds_threads is False
    assert found.holds_diagnostics is False
    assert found.timeouts == config_module.Timeouts() == config_module.Timeouts(**{
        option.name: option.default for option in config_module.TIMEOUT_OPTIONS})
    assert found.retries == config_module.Retries() == config_module.Retries(**{
        option.name: option.initial("r") for option in config_module.RETRY_OPTIONS})
    assert (found.timeouts.connect, found.timeouts.read, found.timeouts.total) == (
        10.0, 600.0, None)
    assert (found.retries.attempts, found.retries.backoff, found.retries.max_backoff,
            found.retries.budget) == (1, 0.5, 8.0, 30.0)
    assert found.retries.statuses == {429, 500, 502, 503, 504, 529}


def test_the_declared_backend_choices_are_the_accepted_ones():
    choices = {option.name: option.choices for option in config_module.BACKEND_OPTIONS}
    for key in ("auth", "format"):
        for value in choices[key]:
            entry = backend("http://127.0.0.1:1", **{key: value})
            assert getattr(config_module.parse({"backends": [entry]}).backends[0], key) == value
        with pytest.raises(ConfigError, match=rf"^backends\[0\]\.{key}: must be "):
            config_module.parse({"backends": [backend("http://127.0.0.1:1", **{key: "other"})]})


def test_a_server_key_like_no_other_lists_them_all():
    with pytest.raises(ConfigError) as error:
        config_module.parse({**MINIMAL, "server": {"zzz": 1}})
    names = ", ".join(sorted(option.name for option in config_module.SERVER_OPTIONS))
    assert str(error.value) == f"server.zzz: unknown key (expected one of: {names})"


# What each server key defaulted to before the keys were declared: a config without them must
# go on parsing to the same Config.
TODAY = {"host": "127.0.0.1", "port": 8787, "max_body_bytes": 32 * 1024 * 1024,
         "upstream_connections": 512, "log_level": "INFO", "access_log": False,
         "max_upstream_body_bytes": 64 * 1024 * 1024, "header_timeout": 10.0,
         "body_timeout": 60.0, "max_connections": 1024, "allowed_hosts": [],
         "allow_unauthenticated": False, "log_format": "text", "workers": 1,
         "drain_seconds": 30.0, "unready_seconds": 0.0, "stream_keepalive": 10.0,
         "console": False, "resume_bytes": 64 * 1024 * 1024, "keep_freed_bytes": 64 * 1024 * 1024}


def test_the_declared_defaults_are_the_config_defaults_of_before():
    parsed = config_module.parse(MINIMAL)
    built = config_module.Config(backends=[])
    declared_names = {option.name for option in config_module.SERVER_OPTIONS}
    assert declared_names == set(TODAY) | {"passthrough", "auth"}
    for name, value in TODAY.items():
        for got in (config_module.server_default(name), getattr(parsed, name),
                    getattr(built, name)):
            assert got == value and type(got) is type(value), name
    assert [(route.method, route.segments) for route in parsed.passthrough] == [
        ("GET", ("v1", "models")), ("GET", ("v1", "models", "*"))]
    assert config_module.server_default("auth") is None
    assert parsed.keys is None and parsed.admin_key is None
    assert built.passthrough == [] and built.keys is None


def test_the_docs_tables_hold_every_declared_key():
    spec = importlib.util.spec_from_file_location("docs_generate",
                                                  ROOT / "docs" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    page = generate.server_options()
    tables = {}
    for part in page.split("\n\n| key |")[1:]:
        rows = [line for line in ("| key |" + part).splitlines() if line.startswith("| `")]
        tables[len(tables)] = rows
    declarations = (config_module.SERVER_OPTIONS, config_module.AUTH_OPTIONS,
                    config_module.KEY_OPTIONS, config_module.BACKEND_OPTIONS,
                    config_module.TIMEOUT_OPTIONS, config_module.RETRY_OPTIONS,
                    config_module.CREDENTIAL_OPTIONS, config_module.POOL_OPTIONS,
                    config_module.STATE_OPTIONS)
    assert len(tables) == len(declarations)
    for rows, options in zip(tables.values(), declarations, strict=True):
        assert [row.split("`")[1] for row in rows] == [option.name for option in options]
    server = "\n".join(tables[0])
    assert "| `port` | `8787` | an integer |" in server
    assert "| `log_format` | `text` | `text` / `json` |" in server
    assert "| `passthrough` | `[\"GET /v1/models\", \"GET /v1/models/*\"]` |" in server
    assert "| `name` | (required) |" in tables[2][0]
    assert "<!-- generated: server_options -->" in (ROOT / "docs" / "configuration.md").read_text()


def test_the_auth_table_says_keys_is_required_and_may_be_empty():
    # An auth section without keys is refused; an empty list is allowed (only the keys
    # `relay keys create` stores then pass): the generated table says both.
    spec = importlib.util.spec_from_file_location("docs_generate",
                                                  ROOT / "docs" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    row = next(line for line in generate.server_options().splitlines()
               if line.startswith("| `keys` |"))
    assert row.startswith("| `keys` | (required) |") and "`[]`" in row
    server = {"backends": [{"name": "a", "url": "http://127.0.0.1:1"}]}
    assert config_module.parse({**server, "server": {"auth": {"keys": []}}}).keys == []
    with pytest.raises(ConfigError, match=r"^server\.auth\.keys: required$"):
        config_module.parse({**server, "server": {"auth": {}}})


def test_the_configuration_example_shows_every_server_key():
    page = (ROOT / "docs" / "configuration.md").read_text()
    example = yaml.safe_load(page.split("```yaml", 1)[1].split("```", 1)[0])
    assert list(example["server"]) and set(example["server"]) == {
        option.name for option in config_module.SERVER_OPTIONS}
    assert set(example["server"]["auth"]["keys"][0]) | {"key_file"} == {
        option.name for option in config_module.KEY_OPTIONS}


def test_serve_help_shows_the_declared_defaults():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    text = " ".join(parser.format_help().split())
    for flag, name in (("--host", "host"), ("--port", "port"), ("--workers", "workers"),
                       ("--log-format", "log_format")):
        assert f"override server.{name}" in text
        assert f"default {config_module.server_default(name)}" in text, flag
