"""The docs site's generated reference holds everything it is generated from (the build
itself, strict, is `make docs`, part of `make test`), and what the pages say of the operator's
interface (relay.yaml's keys and examples, the command line, metrics, headers, routes, the
access log) is what the code declares."""

import argparse
import importlib.util
import json
import re
import textwrap
from pathlib import Path

import pytest
import yaml

from relay import cli, hookspecs
from relay import config as config_module
from relay.chain import Chain, load_plugins
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


# --- the docs against the interface ---------------------------------------------------------
# Each check below reads what the docs say about one part of the operator's interface (config
# keys, YAML examples, command-line flags, metrics, headers, routes, access-log fields) and
# holds it to what the code declares, both ways where the docs mean to be complete.

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md")) + sorted((DOCS / "reference").glob("*.md"))


class _Page:
    def __init__(self, path: Path):
        class file:
            src_path = str(path.relative_to(DOCS))
        self.file = file


def rendered(path: Path) -> str:
    """A page as the site shows it: its generated parts filled in."""
    return generate.on_page_markdown(path.read_text(), _Page(path), None, None)


def unreleased() -> str:
    """The CHANGELOG's unreleased section: what it names is what the code names now."""
    text = (ROOT / "CHANGELOG.md").read_text()
    return text.split("(unreleased)", 1)[1].split("\n## ", 1)[0]


def operator_texts() -> list[tuple[str, str]]:
    """Every text an operator reads about the interface, by name."""
    return ([(str(p.relative_to(ROOT)), rendered(p)) for p in PAGES]
            + [("README.md", (ROOT / "README.md").read_text()),
               ("relay.yaml", (ROOT / "relay.yaml").read_text()),
               ("CHANGELOG.md (unreleased)", unreleased())])


YAML_FENCE = re.compile(r"^(?P<indent>[ \t]*)```ya?ml[ \t]*\n(?P<body>.*?)^(?P=indent)```",
                        re.MULTILINE | re.DOTALL)
TOP_LEVEL = {"server", "pipeline", "plugins", "backends", "state", "telemetry"}
# Fenced YAML in the docs that is another program's configuration, by its first key.
NOT_RELAY_YAML = {"scrape_configs"}  # Prometheus's (telemetry.md)


def yaml_examples():
    for path in [*PAGES, ROOT / "README.md"]:
        text = path.read_text()
        for match in YAML_FENCE.finditer(text):
            raw = yaml.safe_load(textwrap.dedent(match.group("body")))
            if isinstance(raw, dict) and next(iter(raw), None) in NOT_RELAY_YAML:
                continue
            line = text.count("\n", 0, match.start()) + 1
            yield pytest.param(raw, id=f"{path.relative_to(ROOT)}:{line}")


def as_relay_yaml(raw) -> dict:
    """An example as the whole relay.yaml it stands for: a list of backends is the
    ``backends:`` section, ``credentials:`` alone a backend's, each in the shipped relay.yaml
    (its pipeline and plugin options); a config without backends gets one (relay.yaml needs
    one)."""
    shipped = yaml.safe_load((ROOT / "relay.yaml").read_text())
    around = {"pipeline": shipped["pipeline"], "plugins": shipped["plugins"]}
    if isinstance(raw, list):
        raw = {**around, "backends": raw}
    elif isinstance(raw, dict) and set(raw) == {"credentials"}:
        raw = {**around,
               "backends": [{"name": "pooled", "url": "https://api.anthropic.com", **raw}]}
    assert isinstance(raw, dict) and set(raw) <= TOP_LEVEL, f"not relay.yaml: {raw!r:.200}"
    return {"backends": [{"name": "any", "url": "http://127.0.0.1:8788"}], **raw}


@pytest.mark.parametrize("raw", list(yaml_examples()))
def test_every_yaml_example_is_a_config_the_relay_accepts(raw):
    """As ``relay validate --config`` loads it (offline: no key need be set), with the options
    of every plugin it configures checked against their declarations, in the pipeline or
    not."""
    config = config_module.parse(as_relay_yaml(raw), env={}, require_keys=False)
    config.pipeline = list(dict.fromkeys([*config.pipeline, *config.plugins]))
    Chain(load_plugins(config.pipeline), config)


def command_parsers() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Each command's parser, and each of its subcommands' (``keys create``), by their words."""
    found = {}
    for name in cli.COMMANDS:
        parser = _subcommands(cli.build_parser(name))[name]
        found[(name,)] = parser
        for word, nested in _subcommands(parser).items():
            found[(name, word)] = nested
    return found


def _subcommands(parser: argparse.ArgumentParser) -> dict:
    return next((action.choices for action in parser._actions
                 if isinstance(action, argparse._SubParsersAction)), {})


def flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings
            if flag.startswith("--")} - {"--help"}


FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def test_every_flag_of_every_command_is_on_the_command_line_page():
    page = (DOCS / "cli.md").read_text()
    documented = set(FLAG.findall(page))
    missing = {" ".join(words): sorted(flags(parser) - documented)
               for words, parser in command_parsers().items() if flags(parser) - documented}
    assert not missing


def test_every_flag_the_command_line_page_names_is_a_flag():
    every = set().union(*map(flags, command_parsers().values()))
    assert set(FLAG.findall((DOCS / "cli.md").read_text())) - every == set()


# A command as the docs write it in code: `relay usage --by model`, `python -m relay ...`.
COMMAND = re.compile(r"(?:^|(?<=[`\s]))(?:\.venv/bin/)?(?:python -m )?relay((?: [^`\n]*)?)"
                     r"(?=`|$)", re.MULTILINE)


def test_every_command_the_docs_show_takes_the_flags_they_give_it():
    parsers = command_parsers()
    wrong = []
    for name, text in operator_texts():
        if name == "docs/cli.md":  # its synopsis puts several commands on a line; see above
            continue
        for match in COMMAND.finditer(text):
            words = match.group(1).split()
            if words and words[0] in cli.COMMANDS:
                command = tuple(words[:2]) if tuple(words[:2]) in parsers else (words[0],)
            elif not words or words[0].startswith("-"):
                command = ("serve",)
            else:
                continue  # prose: "relay keeps ..."
            for flag in FLAG.findall(match.group(1)):
                if flag not in flags(parsers[command]) | {"--help"}:
                    wrong.append(f"{name}: relay {' '.join(command)} {flag}")
    assert not wrong


def test_every_generated_part_is_on_one_page():
    asked = [match.group(1) for path in PAGES for match in generate.MARKER.finditer(
        path.read_text())]
    assert sorted(asked) == sorted(generate.PARTS)


def test_every_metric_is_in_the_metrics_reference_with_its_type_and_labels():
    page = generate.metrics()
    families = generate.metric_families()
    assert {family.kind for family in families} == {"counter", "histogram", "gauge"}
    for family in families:
        row = next(line for line in page.splitlines()
                   if line.startswith(f"| `{generate.scraped_name(family)}` |"))
        assert f"| {family.kind} |" in row
        for label in family.labelnames:
            assert f"`{label}`" in row
    metrics = importlib.import_module("relay_builtins.metrics")
    about = (DOCS / "reference" / "metrics.md").read_text()
    assert f"first {metrics.MAX_MODELS} model names" in " ".join(about.split())
    assert f"(the first {metrics.MAX_NAMES},\nthen `other`)" in about


# A metric as the docs name it: `relay_tokens_total{backend, key, model, kind}`,
# `relay_credential_*`, `relay_requests_total{outcome="pool_full"}`.
METRIC = re.compile(r"(?<![\w.])(relay_[a-z0-9_]+)(\*)?(\{[^}]*\})?")
SAMPLES = {"counter": ("_total", "_created"), "histogram": ("", "_bucket", "_sum", "_count"),
           "gauge": ("",)}


def test_every_metric_the_docs_name_is_served_under_that_name_with_those_labels():
    families = {family.name: family for family in generate.metric_families()}
    wrong = []
    for name, text in operator_texts():
        for match in METRIC.finditer(text):
            written, star, braces = match.groups()
            if star:
                matching = [family for family in families.values()
                            if generate.scraped_name(family).startswith(written)]
            else:
                matching = [family for base, family in families.items()
                            if written.startswith(base) and written[len(base):]
                            in SAMPLES[family.kind]]
                if not matching and (braces or written.endswith("_total")
                                     or written in families):
                    matching = [None]  # a metric by its looks, under no name served
            if not matching:
                continue  # a hook, a module, a package: not a metric
            labels = {part.split("=")[0].strip() for part in (braces or "{}")[1:-1].split(",")
                      if part.strip()}
            for family in matching:
                if family is None or not labels <= set(family.labelnames):
                    wrong.append(f"{name}: {match.group(0)}")
    assert not wrong


def test_every_access_log_field_is_on_the_production_page():
    from relay import logs
    from relay.testing import finished_exchange
    from relay.usage import Usage

    exchange = finished_exchange(stream=True, events=7)
    exchange.credential, exchange.key_name = "team-a", "ci"
    exchange.repairs = 1
    exchange.translation["toolu_1-2"] = {"direction": "to_client"}
    exchange.cache = {"status": "miss", "cause": "ttl_expired"}
    exchange.timings.first_byte = 0.25
    exchange.usage = Usage(1, 2, 3, 4, 5, complete=False, reported=False, cost_micro_usd=6)
    fields = logs.access_fields(exchange, 200)
    assert len(fields) == 25  # every field the line can hold, so that none is left unchecked
    page = (DOCS / "operations.md").read_text()
    logged = page.split("**Logs.**", 1)[1].split("\n\n", 1)[0]
    assert [name for name in fields if f"`{name}`" not in logged] == []


def _source() -> str:
    return "\n".join(path.read_text() for folder in ("relay", "plugins")
                     for path in sorted((ROOT / folder).rglob("*.py"))
                     if "testing" not in path.relative_to(ROOT).parts)


def test_every_x_relay_header_and_note_is_on_the_request_page():
    page = (DOCS / "request-flow.md").read_text()
    source = _source()
    headers = set(re.findall(r"x-relay-[a-z]+(?:-[a-z]+)*", source))
    notes = set(re.findall(r"\.flag\(\"([a-z-]+)\"\)", source))
    assert {"x-relay-request-id", "x-relay-notes"} <= headers and notes
    assert sorted(name for name in headers | notes
                  if not re.search(f"`{re.escape(name)}[`:]", page)) == []
    assert set(re.findall(r"x-relay-[a-z]+(?:-[a-z]+)*", page)) <= headers


def test_every_route_the_relay_serves_is_on_the_request_page():
    from relay import console, prepare, server

    config = config_module.Config(backends=[config_module.Backend("a", "http://127.0.0.1:1",
                                                                  [])],
                                  pipeline=list(generate.BUILTINS),
                                  plugins={"dump": {"dir": "dumps"}})
    routes = Chain(load_plugins(config.pipeline), config).routes(config)
    served = ([f"POST {path}" for path in prepare.ENDPOINTS] + ["GET /healthz", "GET /readyz",
              f"GET {server.BACKENDS}", console.PREFIX]
              + [f"{method} {path}" for method, path in routes])
    page = (DOCS / "request-flow.md").read_text()
    assert [route for route in served if f"`{route}`" not in page] == []


# A key of relay.yaml as the docs name it in code: `server.auth.admin_key_env`,
# `plugins.dump.dir`, `pool.refresh`, `state.url: sqlite:///...`.
KEY_PATH = re.compile(r"`((?:server|state|telemetry|plugins|pool|retries|timeouts)"
                      r"(?:\.[a-z_]+)+)(?=[`:\s\[])")
FILES = (".md", ".py", ".db", ".json", ".yaml")


def known_key(path: str) -> bool:
    from relay import telemetry
    from relay.state import OPTIONS as STATE_OPTIONS

    sections = {"server": config_module.SERVER_OPTIONS,
                "server.auth": config_module.AUTH_OPTIONS, "state": STATE_OPTIONS,
                "telemetry": telemetry.OPTIONS, "pool": config_module.POOL_OPTIONS,
                "retries": config_module.RETRY_OPTIONS,
                "timeouts": config_module.TIMEOUT_OPTIONS}
    parts = path.split(".")
    if parts[0] == "plugins":
        if parts[1] not in generate.BUILTINS:
            return False
        return len(parts) == 2 or parts[2] in {option.name for option in declared(
            generate._plugin(parts[1])) or ()}
    for end in range(len(parts) - 1, 0, -1):  # the longest section first; deeper: its values
        section = sections.get(".".join(parts[:end]))
        if section is not None:
            return parts[end] in {option.name for option in section}
    return False


def test_every_key_the_docs_name_is_a_key_of_relay_yaml():
    wrong = []
    for name, text in operator_texts():
        for match in KEY_PATH.finditer(text):
            path = match.group(1)
            after = text[match.end():match.end() + 40]
            if path.endswith(FILES) or after.startswith(": unknown"):  # a file; a misspelling
                continue
            if not known_key(path):
                wrong.append(f"{name}: {path}")
    assert not wrong


def test_every_quirk_the_host_reads_is_documented_with_its_values():
    from relay.beta_filter import QUIRKS as BETA_QUIRKS
    from relay.formats.openai.wire import QUIRKS as OPENAI_QUIRKS

    table = (DOCS / "openai-backends.md").read_text()
    for quirk, choices in OPENAI_QUIRKS.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| `{quirk}` |"))
        values = [str(choice).lower() if isinstance(choice, bool) else choice
                  for choice in choices]
        assert f"| `{values[0]}` (default) / " in row
        assert all(f"`{value}`" in row.split("|")[2] for value in values)
    configuration = (DOCS / "configuration.md").read_text()
    assert all(f"`{quirk}`" in configuration for quirk in BETA_QUIRKS)
    assert config_module.HOST_QUIRKS == {*OPENAI_QUIRKS, *BETA_QUIRKS}


def test_every_page_is_listed_on_the_front_pages():
    index, readme = (DOCS / "index.md").read_text(), (ROOT / "README.md").read_text()
    pages = [str(path.relative_to(DOCS)) for path in PAGES if path.name != "index.md"]
    assert [page for page in pages if f"]({page}" not in index] == []
    assert [page for page in pages if f"](docs/{page}" not in readme] == []
    commands = (DOCS / "cli.md").read_text().split("\n- **")[1:]
    assert [line.split("**")[0] for line in commands] == [c for c in cli.COMMANDS
                                                          if c != "serve"]
    for text in (index, readme):
        listed = text.split("[Command line](", 1)[1].split("\n", 1)[0]
        assert [c for c in cli.COMMANDS if f"`{c}`" not in listed] == []


def test_the_plugin_guide_gives_option_its_whole_signature():
    import dataclasses

    from relay.options import Option

    page = " ".join((DOCS / "writing-a-plugin.md").read_text().split())
    written = page.split("`relay.options.Option(", 1)[1].split(")`", 1)[0]
    names = [part.strip().split("=")[0] for part in written.split(",")]
    assert names == [field.name for field in dataclasses.fields(Option)]


def test_every_file_the_docs_point_to_is_there():
    path = re.compile(r"(?<![\w/.-])(?:relay|plugins|tests|docs|examples)/[\w/.-]*\w"
                      r"\.(?:py|md|json|yaml|toml)\b")
    texts = [(p.name, p.read_text()) for p in PAGES] + [
        (name, (ROOT / name).read_text()) for name in ("README.md", "CONTRIBUTING.md")]
    named = {found for _, text in texts for found in path.findall(text)}
    assert len(named) > 20
    assert sorted(found for found in named if not (ROOT / found).exists()) == []


def test_the_accounting_tables_hold_every_limit_and_usage_column():
    import dataclasses

    from relay import limits
    from relay.usage import Usage

    page = (DOCS / "accounting.md").read_text()
    table = page.split("| limit | counts | window |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split("`")[1].split(":")[0] for line in table.splitlines()
            if line.startswith("| `")]
    assert rows == list(limits.FIELDS)
    budget = next(line for line in table.splitlines() if line.startswith("| `budget"))
    assert all(f"`{period}`" in budget for period in limits.BUDGET_PERIODS)
    for name, family in limits.HEADER_FAMILIES.items():
        assert f"| `anthropic-ratelimit-{family}-limit` / `-remaining` / `-reset` | `{name}`" \
            in page
    usage = page.split("| column | from an Anthropic-format answer |", 1)[1].split("\n\n")[0]
    columns = [line.split("`")[1] for line in usage.splitlines() if line.startswith("| `")]
    assert columns == [field.name for field in dataclasses.fields(Usage)
                       if field.name not in ("complete", "reported", "cost_micro_usd")]


def test_the_cache_verdicts_words_are_on_the_sessions_page():
    from relay_builtins import cache as plugin

    from relay import cache

    page = (DOCS / "sessions.md").read_text()
    causes = (cache.MODEL, cache.SYSTEM, cache.TOOLS, cache.MESSAGES, cache.THINKING,
              cache.TOOL_CHOICE, plugin.BACKEND, plugin.CREDENTIAL, plugin.TTL,
              plugin.UNEXPLAINED)
    table = page.split("| `cause` | what changed |", 1)[1].split("\n\n", 1)[0]
    assert [cause for cause in causes if f"`{cause}`" not in table] == []
    by = page.split("`by` says who changed the prefix", 1)[1].split("\n\n", 1)[0]
    assert [action for action in plugin.REWRITES if f"`{action}`" not in by] == []
    statuses = page.split("| `status` | when |", 1)[1].split("\n\n", 1)[0]
    assert [line.split("`")[1] for line in statuses.splitlines()
            if line.startswith("| `")] == ["hit", "write", "none", "miss"]
