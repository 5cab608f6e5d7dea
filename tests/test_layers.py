"""The request path's floors: preparing a request needs no web server, and the commands that
prepare one (``relay replay``, ``relay validate``) never import the server."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _source(module: str) -> Path | None:
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def imported_at_load(module: str) -> set[str]:
    """Every module importing ``module`` loads, following relay's own modules (imports at a
    module's top level only: a function's import waits until it runs)."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = _source(name)
        if path is None or not name.startswith("relay"):
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                todo += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                where = (f"{base}.{node.module}" if node.module else base) if node.level \
                    else node.module or ""
                todo.append(where)
                # ``from . import x`` and ``from aiohttp import web`` name modules too.
                todo += [f"{where}.{alias.name}" for alias in node.names]
    return seen


def test_preparing_a_request_needs_no_web_server():
    loaded = imported_at_load("relay.prepare")
    assert "aiohttp.web" not in loaded and "relay.server" not in loaded


def test_replay_and_validate_do_not_import_the_server():
    for command in ("relay.replay", "relay.validate"):
        assert "relay.server" not in imported_at_load(command), command


def test_the_check_follows_imports():
    assert "relay.prepare" in imported_at_load("relay.server")
    assert "aiohttp.web" in imported_at_load("relay.respond")
