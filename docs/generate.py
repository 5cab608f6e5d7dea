"""mkdocs hook: fills the reference pages from the code and the evidence table.

A page asks for a generated part with a line of its own, ``<!-- generated: NAME -->``; NAME is
one of :data:`PARTS`. What stands in the code (hook specs and their docstrings, the exchange's
documented attributes, the declared options, the evidence table) is the only source: nothing
generated is committed, so the reference cannot drift from what the relay does.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- generated: ([a-z_]+) -->$", re.MULTILINE)
# Built-in plugins in the shipped pipeline's order; each is documented by its module
# docstring and its declared options.
BUILTINS = ("limits", "usage", "metrics", "cache", "dedup", "pairing", "ordering",
            "portable", "dump")

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc):`~?([^`]+)`")


def markdown(docstring: str | None) -> str:
    """A docstring written for reST readers, as Markdown: ``code`` to `code`, roles to code."""
    text = inspect.cleandoc(docstring or "")
    text = _ROLE.sub(lambda m: f"`{m.group(1)}`", text)
    return text.replace("``", "`")


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def hookspecs() -> str:
    """Every hook spec in source order, under the banner it stands below, with its signature,
    the order the chain calls it in, and its docstring."""
    from relay import hookspecs as module

    source = Path(module.__file__).read_text()
    banners = {node_line: title for node_line, title in _banners(source)}
    parts = [markdown(module.__doc__), ""]
    tree = ast.parse(source)
    pending = sorted(banners.items())
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or not node.name.startswith("relay_"):
            continue
        while pending and pending[0][0] < node.lineno:
            parts += [f"## {pending.pop(0)[1].capitalize()}", ""]
        spec = getattr(module, node.name)
        order = getattr(spec, "relay_order", "")
        returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
        parts += [f"### `{node.name}`", "",
                  f"```python\ndef {node.name}({ast.unparse(node.args)}){returns}\n```", "",
                  f"Called in {order}." if order else "", "", markdown(spec.__doc__), ""]
    return "\n".join(parts)


def _banners(source: str):
    for number, line in enumerate(source.splitlines(), 1):
        found = re.match(r"# --- (.+?) -+$", line)
        if found:
            yield number, found.group(1)


def exchange() -> str:
    """The record plugins share, from its classes' docstrings and properties."""
    from relay import exchange as module

    parts = []
    fields = _field_docs(Path(module.__file__).read_text())
    for name in ("Exchange", "Outcome", "Attempt", "UpstreamRequest", "UpstreamAnswer",
                 "StreamFailure", "Uncertainty", "Repair", "Timings", "Answer",
                 "UpstreamResponse"):
        cls = getattr(module, name, None)
        if cls is None:
            continue
        parts += [f"## `{name}`", "", markdown(cls.__doc__), ""]
        if fields.get(name):
            parts += ["| field | meaning |", "|---|---|"]
            parts += [f"| `{field}` | {_cell(markdown(doc))} |" for field, doc in fields[name]]
            parts.append("")
        members = []
        for attr, value in vars(cls).items():
            if attr.startswith("_"):
                continue
            doc = inspect.getdoc(value) if isinstance(value, property) or callable(value) else None
            if doc:
                kind = "property" if isinstance(value, property) else "method"
                members.append((attr, kind, doc))
        for attr, kind, doc in members:
            signature = ""
            if kind == "method":
                signature = str(inspect.signature(getattr(cls, attr))).replace("(self, ", "(") \
                    .replace("(self)", "()")
            parts += [f"### `{attr}{signature}`", "", markdown(doc), ""]
    return "\n".join(parts)


def _field_docs(source: str) -> dict[str, list[tuple[str, str]]]:
    """Per class, its fields (or enum members) with the docstring that follows each, in
    source order: Python keeps no such docstring at run time."""
    found: dict[str, list[tuple[str, str]]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for here, after in zip(body, body[1:]):
            target = (here.target if isinstance(here, ast.AnnAssign)
                      else here.targets[0] if isinstance(here, ast.Assign) else None)
            if (isinstance(target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                value = getattr(here, "value", None)
                shown = (f"{target.id} = {ast.unparse(value)}"
                         if isinstance(here, ast.Assign) and value is not None else target.id)
                found.setdefault(node.name, []).append((shown, after.value.value))
    return found


def options() -> str:
    """One table per built-in plugin: its declared options."""
    from relay.options import declared, markdown_table

    parts = []
    for name in BUILTINS:
        found = declared(_plugin(name))
        parts += [f"## `{name}`", "", markdown_table(found) if found else "No options.", ""]
    return "\n".join(parts)


def server_options() -> str:
    """The host's own keys (``server:``, ``server.auth``, each backend's), from their
    declarations."""
    from relay import config
    from relay.options import markdown_table

    parts = []
    for title, options in (("`server`", config.SERVER_OPTIONS),
                           ("`server.auth`", config.AUTH_OPTIONS),
                           ("Each of `server.auth.keys`", config.KEY_OPTIONS),
                           ("Each of `backends`", config.BACKEND_OPTIONS),
                           ("A backend's `timeouts`", config.TIMEOUT_OPTIONS),
                           ("A backend's `retries`", config.RETRY_OPTIONS),
                           ("Each of a backend's `credentials`", config.CREDENTIAL_OPTIONS),
                           ("A backend's `pool`", config.POOL_OPTIONS),
                           ("`state` (see [Shared state](state.md))", config.STATE_OPTIONS)):
        parts += [f"{title}:", "", markdown_table(options, quirks=False), ""]
    return "\n".join(parts)


def telemetry_options() -> str:
    """relay.yaml's ``telemetry:`` section, from its declarations."""
    from relay import telemetry
    from relay.options import markdown_table

    return markdown_table(telemetry.OPTIONS, quirks=False)


def metric_families() -> list:
    """The metrics plugin's families, as one that has started makes them (each a
    ``relay_builtins.metrics.Family``: ``kind``, ``name``, ``labelnames``, ``documentation``),
    in the order it declares them."""
    from relay.config import Config
    from relay.state import State

    module = importlib.import_module("relay_builtins.metrics")
    plugin = module.Metrics()
    plugin.relay_startup(config=Config(backends=[]),
                         options={"path": "/metrics", "scrape_key_env": ""}, state=State())
    return [value for value in vars(plugin).values() if isinstance(value, module.Family)]


def scraped_name(family) -> str:
    """A family's name as a scrape shows it: a counter's with ``_total``."""
    return family.name + "_total" if family.kind == "counter" else family.name


def metrics() -> str:
    """Every metric the metrics plugin serves: its name as scraped, type, labels, help."""
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for family in metric_families():
        labels = ", ".join(f"`{label}`" for label in family.labelnames) or "—"
        rows.append(f"| `{scraped_name(family)}` | {family.kind} | {labels} | "
                    f"{_cell(family.documentation)} |")
    return "\n".join(rows)


def _plugin(name: str):
    """A built-in as the entry point loads it: its module, or the class in it that declares
    the options."""
    module = importlib.import_module(f"relay_builtins.{name}")
    return next((value for value in vars(module).values()
                 if inspect.isclass(value) and value.__module__ == module.__name__
                 and getattr(value, "OPTIONS", None) is not None), module)


def plugins() -> str:
    """Each built-in plugin's own account of itself (its module docstring)."""
    parts = []
    for name in BUILTINS:
        module = importlib.import_module(f"relay_builtins.{name}")
        text = markdown(module.__doc__)
        # The docstring's first line names the plugin already; it becomes the heading.
        first, _, rest = text.partition("\n")
        parts += [f"## `{name}`", "", first.split(":", 1)[-1].strip(), "", rest.strip(), ""]
    return "\n".join(parts)


def rules() -> str:
    """The history rules, from the evidence table: one row per rule, with its verdict, the
    API's words and where they point, and the sources it rests on."""
    table = json.loads((ROOT / "docs" / "evidence" / "rules.json").read_text())
    parts = ["| rule | plugin | verdict | the API's words (where they point) | sources |",
             "|---|---|---|---|---|"]
    for rule in table["rules"]:
        verdict = rule.get("verdict", "")
        if rule.get("repair"):
            verdict += f"; repair: {rule['repair']}"
        words = rule.get("error") or ""
        if rule.get("location"):
            words += f" ({rule['location']})"
        parts.append(f"| `{rule['id']}` | {rule.get('plugin', '')} | {_cell(verdict)} | "
                     f"{_cell(words)} | {_cell('; '.join(rule.get('sources', ())))} |")
    return "\n".join(parts) + "\n\n" + table.get("about", "")


PARTS = {"hookspecs": hookspecs, "exchange": exchange, "options": options,
         "server_options": server_options, "plugins": plugins, "rules": rules,
         "telemetry_options": telemetry_options, "metrics": metrics}


def on_page_markdown(markdown_text: str, page, config, files) -> str:
    def fill(match: re.Match) -> str:
        name = match.group(1)
        if name not in PARTS:
            raise KeyError(f"{page.file.src_path}: no generated part named {name!r}")
        return PARTS[name]()

    return MARKER.sub(fill, markdown_text)
