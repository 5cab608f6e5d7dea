"""The docs site's generated reference holds everything it is generated from (the build
itself, strict, is `make docs`, part of `make test`)."""

import importlib.util
import json
from pathlib import Path

import pytest

from relay import hookspecs
from relay.options import declared

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
generate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(generate)


def test_every_hook_is_in_the_reference_with_its_order():
    page = generate.hookspecs()
    names = [name for name in dir(hookspecs) if name.startswith("relay_")]
    assert names
    for name in names:
        section = page.split(f"### `{name}`", 1)[1].split("### ", 1)[0]
        assert f"def {name}(" in section
        assert f"Called in {getattr(hookspecs, name).relay_order}." in section


def test_every_declared_option_of_every_builtin_is_in_its_table():
    page = generate.options()
    for name in generate.BUILTINS:
        table = page.split(f"## `{name}`", 1)[1].split("\n## ", 1)[0]
        for option in declared(generate._plugin(name)) or ():
            assert f"| `{option.name}` |" in table


def test_every_rule_of_the_evidence_table_has_its_section():
    page = generate.rules()
    for rule in json.loads((ROOT / "docs" / "evidence" / "rules.json").read_text())["rules"]:
        row = next(line for line in page.splitlines() if line.startswith(f"| `{rule['id']}` |"))
        if rule.get("error"):
            assert rule["error"].replace("|", "\\|") in row


def test_a_page_asking_for_an_unknown_part_fails_the_build():
    class Page:
        class file:
            src_path = "x.md"

    assert generate.on_page_markdown("a\n<!-- generated: rules -->\n", Page, None, None) \
        .startswith("a\n")
    with pytest.raises(KeyError, match="nothing"):
        generate.on_page_markdown("<!-- generated: nothing -->", Page, None, None)


def test_docstring_roles_become_code():
    assert generate.markdown("see :class:`relay.exchange.Exchange` and ``x``") \
        == "see `relay.exchange.Exchange` and `x`"
