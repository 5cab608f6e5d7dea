"""The format seam holds: no module outside relay/formats/ asks which wire format a backend
speaks; it asks the backend's adapter instead (relay.formats.base.Adapter)."""

from __future__ import annotations

import ast
from pathlib import Path

from relay import config as config_module
from relay.formats import ADAPTERS, FORMATS, base

ROOT = Path(__file__).resolve().parent.parent
FORMAT_NAMES = frozenset(FORMATS)


def _asks_format(node: ast.AST, imported: frozenset[str]) -> bool:
    """Whether an operand of a comparison names a format: ``x.format``, a name taken from
    relay.formats (its list of formats), or a format's name as a string."""
    if isinstance(node, ast.Attribute):
        return node.attr == "format" or (isinstance(node.value, ast.Name)
                                          and node.value.id == "formats")
    if isinstance(node, ast.Name):
        return node.id in imported
    if isinstance(node, ast.Constant):
        return node.value in FORMAT_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_asks_format(item, imported) for item in node.elts)
    return False


def format_branches(source: str) -> list[int]:
    """The lines of ``source`` that compare something with a wire format."""
    tree = ast.parse(source)
    imported = frozenset(alias.asname or alias.name for node in ast.walk(tree)
                         if isinstance(node, ast.ImportFrom)
                         and (node.module or "").split(".")[-1] == "formats"
                         for alias in node.names)
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Compare)
            and any(_asks_format(operand, imported)
                    for operand in [node.left, *node.comparators])]


def test_no_module_outside_the_formats_package_branches_on_a_format():
    formats = ROOT / "relay" / "formats"
    # The emulators are upstreams of one format each, not the relay's own path.
    testing = ROOT / "relay" / "testing"
    found = []
    for path in sorted([*(ROOT / "relay").rglob("*.py"), *(ROOT / "plugins").rglob("*.py")]):
        if formats in path.parents or testing in path.parents:
            continue
        found += [f"{path.relative_to(ROOT)}:{line}"
                  for line in format_branches(path.read_text())]
    assert found == []


def test_the_check_finds_the_branches_it_is_for():
    assert format_branches('if backend.format == "openai":\n    pass\n') == [1]
    assert format_branches('x = b.format != "anthropic"\n') == [1]
    assert format_branches("from .formats import THREAD_FORMATS\n"
                           "ok = kind in THREAD_FORMATS\n") == [2]
    assert format_branches("ok = kind not in formats.FORMATS\n") == [1]
    assert format_branches("FORMATS = (1, 2)\nok = version in FORMATS\n") == []
    assert format_branches('ok = kind in ("openai", "other")\n') == [1]
    assert format_branches("ok = backend.adapter.carries_threads\n") == []
    assert format_branches('ok = log_format == "json"\n') == []


def test_every_backend_gets_its_format_adapter_when_the_config_loads():
    config = config_module.parse({"backends": [
        {"name": "a", "url": "http://127.0.0.1:9", "models": ["claude-*"]},
        {"name": "o", "url": "http://127.0.0.1:9/v1", "format": "openai", "models": ["*"]}]},
        {})
    anthropic, openai = config.backends
    assert anthropic.adapter is ADAPTERS["anthropic"] is base.ANTHROPIC
    assert openai.adapter is ADAPTERS["openai"]
    assert openai.auth == "bearer" and anthropic.auth == "x-api-key"


def test_anthropics_adapter_is_the_identity():
    adapter = base.ANTHROPIC
    body = b'{"model":"m","messages":[]}'
    assert adapter.upstream_target("/v1/messages", "beta=true") == ("/v1/messages", "beta=true")
    assert adapter.request_body(body, None, "messages") is body
    answer, unreported = adapter.answer_body(body, "b", "m")
    assert answer is body and unreported == ()
    assert adapter.error_body(400, body, "id") is None
    assert adapter.stream_translator("b", "m") is None
    assert adapter.count_tokens(body) is None
    assert adapter.model_list(body, "b") is body
