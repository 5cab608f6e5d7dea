"""Declared plugin options: checked at start-up, each plugin sees its own (the docs' tables are
the declarations)."""

from __future__ import annotations

import pytest

from relay import config as config_module
from relay.chain import Chain, load_plugins
from relay.errors import ConfigError
from relay.hookspecs import hookimpl
from relay.options import Option
from support import backend


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
