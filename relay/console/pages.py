"""The console's HTML, rendered on the server from plain data: every value that came from
the record goes through :func:`e` (HTML-escaped), and the only markup is this module's."""

from __future__ import annotations

import datetime as dt
import difflib
import string
from html import escape
from importlib import resources
from typing import Any
from urllib.parse import urlencode

from .. import document
from . import record, svg

PAGES = (("overview", "/console", "Overview"), ("keys", "/console/keys", "Keys"),
         ("sessions", "/console/sessions", "Sessions"),
         ("exchanges", "/console/exchanges", "Exchanges"), ("dumps", "/console/dumps", "Dumps"),
         ("backends", "/console/backends", "Backends"))
# What one block of a payload shows at most, and how many messages around the offending one.
BLOCK_CHARS = 4000
AROUND = 2
# Equal lines around a difference kept in the side-by-side replay; longer equal runs than
# COLLAPSE lines are cut to that context.
DIFF_CONTEXT = 10
COLLAPSE = 60
# The most lines of each side matched line by line, once the head and tail both share are set
# aside: difflib's matcher takes time growing with the square of lines that repeat (a client's
# request of many like messages, as a dump holds it: 32,000 lines took 42 s of CPU, holding the
# GIL, at each look). A longer difference is marked whole, as one change.
DIFF_LINES = 2000
# What one dump's page draws at most: a dump holds up to 64 MiB, which drawn whole was a page
# as large (the browser stalled on it, and the relay spent seconds making it). Of the
# rejected request, the messages nearest the one the error names (the first ones, when it
# names none), up to PAYLOAD_CHARS of markup and MESSAGES_SHOWN messages, BLOCKS_SHOWN blocks
# of each; of the replay, DIFF_SHOWN lines of each side, each line cut at LINE_CHARS; of a
# timeline, TIMELINE_STEPS steps. The page says what it left out and links the raw file.
PAYLOAD_CHARS = 500_000
MESSAGES_SHOWN = 500
BLOCKS_SHOWN = 50
KINDS_SHOWN = 20
DIFF_SHOWN = 1000
LINE_CHARS = 1000
TIMELINE_STEPS = 200
TRANSLATION_ROWS = 200


def e(value: Any) -> str:
    return escape("" if value is None else str(value), quote=True)


def _template(name: str) -> string.Template:
    return string.Template(resources.files(__package__).joinpath("templates").joinpath(name)
                           .read_text(encoding="utf-8"))


LAYOUT = _template("page.html")


def layout(title: str, main: str, current: str | None = None, csrf: str | None = None) -> str:
    nav = "".join(f'<a href="{href}"{" aria-current=page" if name == current else ""}>{label}</a>'
                  for name, href, label in PAGES) if csrf is not None else ""
    logout = (f'<form method="post" action="/console/logout">{hidden(csrf)}'
              f'<button type="submit">Log out</button></form>') if csrf is not None else ""
    return LAYOUT.substitute(title=e(title), nav=nav, logout=logout, main=main)


def hidden(csrf: str | None) -> str:
    return f'<input type="hidden" name="csrf" value="{e(csrf)}">'


def when(timestamp: float | None) -> str:
    if not isinstance(timestamp, (int, float)):
        return ""
    return dt.datetime.fromtimestamp(timestamp, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def usd(value: float) -> str:
    return f"${value:,.4f}" if value < 1 else f"${value:,.2f}"


def link(path: str, text: Any, **query: Any) -> str:
    target = f"{path}?{urlencode(query)}" if query else path
    return f'<a href="{e(target)}">{e(text)}</a>'


def notice(text: str, bad: bool = False) -> str:
    return f'<p class="notice{" bad" if bad else ""}" role="status">{e(text)}</p>'


def table(headers: list[str], rows: list[list[str]], numeric: frozenset = frozenset()) -> str:
    """``rows`` are already HTML (each cell escaped by its maker)."""
    head = "".join(f'<th scope="col"{" class=num" if i in numeric else ""}>{e(h)}</th>'
                   for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f'<td{" class=num" if i in numeric else ""}>{cell}</td>'
                                    for i, cell in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def not_configured(what: str, why: str) -> str:
    return notice(f"{what}: not configured ({why}).")


# --- login ---------------------------------------------------------------------------------


def login(csrf: str, message: str | None = None) -> str:
    main = (notice(message, bad=True) if message else "") + (
        '<form class="login" method="post" action="/console/login">'
        f'{hidden(csrf)}<label for="key">Admin key</label>'
        '<input id="key" name="key" type="password" autocomplete="current-password" required '
        'autofocus><button type="submit">Log in</button></form>'
        '<p class="muted">The operator\'s admin key (server.auth.admin_key_env or '
        'admin_key_file). A client\'s relay key cannot log in.</p>')
    return layout("Log in", main)


# --- overview ------------------------------------------------------------------------------


def overview(data: dict) -> str:
    hour, day = data["hour_start"], data["day_start"]

    def points(name: str, span: str) -> list[tuple[str, float]]:
        start, size = (hour, 60) if span == "hour" else (day, 3600)
        fmt = "%H:%M"
        return [(dt.datetime.fromtimestamp(start + i * size, dt.timezone.utc).strftime(fmt), v)
                for i, v in enumerate(data[name][span])]

    def ratio(value: float | None) -> str:
        return "no cacheable input" if value is None else f"{value:.0%}"

    cards = []
    for name, title, shown in (("requests", "Requests", None), ("errors", "Errors", None),
                               ("repairs", "Repairs and id rewrites", None),
                               ("spend", "Spend", usd)):
        total_hour, total_day = sum(data[name]["hour"]), sum(data[name]["day"])
        fmt = shown or (lambda v: f"{v:g}")
        cards.append(
            f'<section class="card" aria-label="{e(title)}"><h2>{e(title)}</h2>'
            f'<p><span class="big" data-metric="{name}-hour">{e(fmt(total_hour))}</span> '
            f'<span class="muted">last hour</span> · <span data-metric="{name}-day">'
            f'{e(fmt(total_day))}</span> <span class="muted">last day</span></p>'
            f'<p class="caption">last hour, by minute</p>'
            f'{svg.bars(points(name, "hour"), f"{title}, last hour by minute", fmt)}'
            f'<p class="caption">last day, by hour</p>'
            f'{svg.bars(points(name, "day"), f"{title}, last day by hour", fmt)}</section>')
    cards.append(
        '<section class="card" aria-label="Prompt cache"><h2>Prompt cache hit ratio</h2>'
        f'<p><span class="big" data-metric="cache-hour">{ratio(data["cache_hour"])}</span> '
        f'<span class="muted">last hour</span> · <span data-metric="cache-day">'
        f'{ratio(data["cache_day"])}</span> <span class="muted">last day</span></p>'
        '<p class="muted">cache reads over all input tokens (fresh, written and read)</p>'
        '</section>')
    for field, title in (("backend", "backend"), ("key", "relay key")):
        rows = [[e(entry["name"]),
                 f'{entry["ratio"]:.0%}' if entry["ratio"] is not None else "-",
                 f'{entry["read"]:,}',
                 f'{entry["written"]:,}', f'{entry["fresh"]:,}', str(entry["breaks"])]
                for entry in data["cache_by"][field]]
        cards.append(
            f'<section class="card" aria-label="Prompt cache by {title}">'
            f'<h2>Prompt cache by {title}</h2>'
            + (table([title.capitalize(), "Hit ratio", "Read", "Written", "Fresh", "Breaks"],
                     rows, frozenset({1, 2, 3, 4, 5}))
               if rows else '<p class="muted">no exchanges in the last day</p>')
            + '<p class="muted">input tokens of the last day, by what the cache did with '
              'them</p></section>')
    return (f'<p class="muted">{data["total"]} exchanges on record in the last day (the shared '
            f'ledger: every worker and replica).</p><div class="cards">{"".join(cards)}</div>')


# --- keys ----------------------------------------------------------------------------------


def keys(listed: list[dict], usage: dict[str, list], spend: dict[str, list],
         csrf: str, message: str | None = None, secret: tuple[str, str] | None = None) -> str:
    parts = []
    if secret is not None:
        parts.append(f'<p class="notice" role="status">Key <b>{e(secret[0])}</b> created. '
                     f'Its secret, shown this once: <code class="secret" id="new-secret">'
                     f'{e(secret[1])}</code></p>')
    if message:
        parts.append(notice(message, bad=True))
    rows = []
    for key in listed:
        name = str(key.get("name"))
        meters = "".join(
            f'<div>{e(label)}: {e(f"{used:g}")} / {e(f"{limit:g}")} '
            f'{svg.meter(used, limit, f"{name} {label}: {used:g} of {limit:g}")}</div>'
            for label, used, limit in usage.get(name, ()))
        state = key.get("status") or ("revoked" if key.get("revoked") else "active")
        if key.get("source") == "relay.yaml":
            rows.append([e(name), "configured in relay.yaml", "", "", meters or
                         '<span class="muted">no limits</span>', spark(spend.get(name, []), name),
                         '<span class="muted">edit relay.yaml</span>'])
            continue
        actions = "" if key.get("revoked") else (
            f'<form class="inline" method="post" action="/console/keys/revoke">{hidden(csrf)}'
            f'<input type="hidden" name="name" value="{e(name)}">'
            f'<button class="danger" type="submit" aria-label="revoke {e(name)}">Revoke'
            f'</button></form>')
        limits = document.orjson.dumps(key.get("limits") or {}, default=str).decode()
        change = (f'<form method="post" action="/console/keys/limits">{hidden(csrf)}'
                  f'<input type="hidden" name="name" value="{e(name)}">'
                  f'<label for="limits-{e(name)}">limits (YAML or JSON)</label>'
                  f'<input id="limits-{e(name)}" name="limits" value="{e(limits)}" size="30">'
                  f'<button type="submit">Set</button></form>')
        rows.append([e(name), e(state), when(key.get("created")),
                     when(key.get("expires")) or "never", meters or '<span class="muted">no '
                     'limits</span>', spark(spend.get(name, []), name), actions + change])
    parts.append(table(["Key", "State", "Created", "Expires", "Usage against limits",
                        "Spend by day", "Actions"], rows))
    parts.append(
        '<h2>Create a key</h2><form class="filters" method="post" action="/console/keys/create">'
        f'{hidden(csrf)}<div><label for="new-name">name</label><input id="new-name" name="name" '
        'required pattern="[A-Za-z0-9._-]+"></div><div><label for="new-limits">limits (YAML '
        'or JSON, optional)</label><input id="new-limits" name="limits" size="40"></div>'
        '<button type="submit">Create</button></form>')
    return "".join(parts)


def spark(points: list, name: str) -> str:
    chart = svg.bars(points, f"{name}: spend by day", usd, width=240, height=70)
    return f'<div class="spark">{chart}</div>'


# --- sessions and exchanges ----------------------------------------------------------------


def _top(tally) -> str:
    return ", ".join(f"{e(name)} ({count})" if len(tally) > 1 else e(name)
                     for name, count in tally.most_common(3))


def sessions(found: list[dict], page: int, pages: int) -> str:
    rows = []
    for s in found:
        breaks = "".join(f'<div>{link("/console/exchange", "turn", id=row_id)}: '
                         f'{e(cache.get("cause"))}'
                         f'{" at " + e(cache["where"]) if cache.get("where") else ""}</div>'
                         for row_id, cache in s["breaks"][:5])
        total = s["read"] + s["written"] + s["fresh"]
        rows.append([link("/console/session", s["session"][:16], id=s["session"]),
                     when(s["last"]), str(s["turns"]), _top(s["backends"]), _top(s["models"]),
                     str(s["repairs"]), str(s["rewrites"]), str(s["errors"]),
                     f'{s["read"] / total:.0%}' if total else "-",
                     f'{s["read"]:,} / {s["written"]:,} / {s["fresh"]:,}',
                     breaks or '<span class="muted">none</span>'])
    if not rows:
        return notice("No sessions in the last day.")
    return (table(["Session", "Last seen", "Turns", "Backends", "Models", "Repairs",
                   "Id rewrites", "Errors", "Cache hit ratio",
                   "Input read / written / fresh", "Cache breaks (cause)"], rows,
                  frozenset({2, 5, 6, 7, 8, 9}))
            + pager("/console/sessions", page, pages, {}))


def pager(path: str, page: int, pages: int, query: dict) -> str:
    parts = []
    if page > 0:
        parts.append(link(path, "← newer", **query, page=page - 1))
    parts.append(f'<span class="muted">page {page + 1} of {max(pages, 1)}</span>')
    if page + 1 < pages:
        parts.append(link(path, "older →", **query, page=page + 1))
    return f'<nav class="pager" aria-label="pages of results">{" ".join(parts)}</nav>'


def exchange_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for row in rows:
        broke = record.cache_break(row)
        out.append([link("/console/exchange", row["id"], id=row["id"]), when(row.get("time")),
                    e(row.get("key") or ""), e(row.get("backend") or ""),
                    e(row.get("credential") or ""), e(row.get("model") or ""),
                    e(row.get("status")), e(row.get("outcome")),
                    str(record.repairs_of(row)), str(record.rewrites_of(row)),
                    e(broke.get("cause")) if broke else "",
                    link("/console/dump", "dump", name=dump_name(row)) if row.get("dump") else ""])
    return out


def dump_name(row: dict) -> str:
    """The ledger row's dump as the dumps page names it, ``DAY/FILE``."""
    name = str(row.get("dump") or "")
    if "/" in name:
        name = "/".join(name.rsplit("/", 2)[-2:])
    elif record.DUMP_NAME.match(name):
        day = dt.datetime.fromtimestamp(row["time"], dt.timezone.utc).strftime("%Y-%m-%d")
        name = f"{day}/{name}"
    return name


EXCHANGE_HEADERS = ["Exchange", "Time", "Key", "Backend", "Credential", "Model", "Status",
                    "Outcome", "Repairs", "Id rewrites", "Cache break", "Dump"]


def exchanges(rows: list[dict], filters: dict, has_more: bool, choices: dict) -> str:
    fields = []
    for name in ("key", "backend", "status", "outcome"):
        options = "".join(f'<option{" selected" if filters.get(name) == str(v) else ""}>'
                          f'{e(v)}</option>' for v in choices.get(name, ()))
        fields.append(f'<div><label for="f-{name}">{name}</label><select id="f-{name}" '
                      f'name="{name}"><option value="">any</option>{options}</select></div>')
    form = (f'<form class="filters" method="get" action="/console/exchanges">{"".join(fields)}'
            '<button type="submit">Filter</button></form>')
    if not rows:
        return form + notice("No exchange matches.")
    more = ""
    if has_more:
        query = {k: v for k, v in filters.items() if v}
        more = ('<nav class="pager" aria-label="pages of results">'
                + link("/console/exchanges", "older →", **query, before=repr(rows[-1]["time"]))
                + "</nav>")
    return form + table(EXCHANGE_HEADERS, exchange_rows(rows)) + more


def session(key: str, rows: list[dict]) -> str:
    if not rows:
        return notice("No exchange of this session is on record.")
    found = record.sessions(rows)[0]
    return (f'<p>Session <code>{e(key)}</code>: {found["turns"]} exchanges from '
            f'{when(found["first"])} to {when(found["last"])}.</p>'
            + table(EXCHANGE_HEADERS, exchange_rows(rows)))


def _step_lane(entry: dict) -> str:
    return str(entry.get("step") or "relay")


def _described(entry: dict) -> str:
    detail = {k: v for k, v in entry.items() if k not in ("t", "step", "action")}
    text = f'{entry.get("action")}'
    if detail:
        text += " " + ", ".join(f"{k}={shown(v)}" for k, v in list(detail.items())[:4])
    return text[:110]


def shown(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return document.orjson.dumps(value).decode()[:60]
    return str(value)[:60]


ONE_ATTEMPT = frozenset({"retrying", "fallback"})
AFTER = frozenset({"upstream error", "queued", "dropped", "stream error", "keep-alive",
                   "translated ids"})


def timeline(row: dict) -> str:
    """The exchange as a sequence: the client's request, each plugin's and the relay's
    steps, each attempt at a backend (and credential), the answer."""
    entries = [entry for entry in row.get("timeline") or () if isinstance(entry, dict)]
    attempts = [a for a in row.get("attempts") or () if isinstance(a, dict)]
    left = max(len(entries) - TIMELINE_STEPS, 0) + max(len(attempts) - TIMELINE_STEPS, 0)
    entries, attempts = entries[:TIMELINE_STEPS], attempts[:TIMELINE_STEPS]
    lanes = ["client", "relay"]
    for entry in entries:
        lane = _step_lane(entry)
        if lane not in lanes:
            lanes.append(lane)
    upstreams = []
    for tried in attempts:
        lane = str(tried.get("backend"))
        if tried.get("credential"):
            lane += f" / {tried['credential']}"
        if lane not in upstreams:
            upstreams.append(lane)
    lanes += upstreams
    steps = [("client", "relay", f'{row.get("endpoint") or "request"} {row.get("model") or ""}')]
    pending = list(attempts)

    def attempt() -> None:
        tried = pending.pop(0)
        lane = str(tried.get("backend"))
        if tried.get("credential"):
            lane += f" / {tried['credential']}"
        wait = tried.get("wait_ms")
        steps.append(("relay", lane, "attempt" + (f" after {wait} ms" if wait else "")))
        steps.append((lane, "relay", f'{tried.get("status")}'))

    # Attempts carry no time: each goes before the note its answer led to (a retry, a
    # fallback), the rest before the first step of the way back.
    for entry in entries:
        if pending and entry.get("action") in ONE_ATTEMPT:
            attempt()
        elif entry.get("action") in AFTER or entry.get("direction") == "to_client":
            while pending:
                attempt()
        lane = _step_lane(entry)
        steps.append((lane, lane, _described(entry)))
    while pending:
        attempt()
    if left > 0:
        steps.append(("relay", "relay", f"… {left:,} more steps, not drawn"))
    steps.append(("relay", "client", f'{row.get("status")} {row.get("outcome")}'))
    return svg.sequence(lanes, steps)


def exchange(row: dict | None) -> str:
    if row is None:
        return notice("No such exchange on record.", bad=True)
    usage = [("input tokens", row.get("input_tokens")), ("output tokens", row.get("output_tokens")),
             ("cache read", row.get("cache_read_input_tokens")),
             ("cache write 5m", row.get("cache_write_5m_input_tokens")),
             ("cache write 1h", row.get("cache_write_1h_input_tokens")),
             ("cost", usd(row["cost_micro_usd"] / 1e6)
              if isinstance(row.get("cost_micro_usd"), int) else "unpriced")]
    facts = [("time", when(row.get("time"))), ("key", row.get("key")),
             ("backend", row.get("backend")), ("credential", row.get("credential")),
             ("model", row.get("model")), ("endpoint", row.get("endpoint")),
             ("stream", row.get("stream")), ("status", row.get("status")),
             ("outcome", row.get("outcome")), ("duration", f'{row.get("duration_ms")} ms'),
             ("repairs", record.repairs_of(row)), ("id rewrites", record.rewrites_of(row))]
    cells = "".join(f"<tr><th scope=row>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in facts)
    used = "".join(f"<tr><th scope=row>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in usage)
    extra = ""
    if row.get("session"):
        session_link = link("/console/session", row["session"][:16], id=row["session"])
        extra += f"<p>Session: {session_link}</p>"
    cache = row.get("cache")
    if isinstance(cache, dict):
        extra += (f'<p>Prompt cache: <b>{e(cache.get("status"))}</b>'
                  + (f', cause <b class="bad">{e(cache.get("cause"))}</b>' if cache.get("cause")
                     else "")
                  + (f' at {e(cache.get("where"))}' if cache.get("where") else "") + "</p>")
    if row.get("dump"):
        extra += f'<p>Dump: {link("/console/dump", dump_name(row), name=dump_name(row))}</p>'
    if row.get("notes"):
        extra += f'<p>Notes: {e(", ".join(map(str, row["notes"])))}</p>'
    steps = table(["Step", "Action", "What it changed"],
                  [[e(_step_lane(entry)), e(entry.get("action")),
                    e(", ".join(f"{k}={shown(v)}" for k, v in entry.items()
                                if k not in ("t", "step", "action")))]
                   for entry in row.get("timeline") or () if isinstance(entry, dict)])
    return (f'<table class="facts"><tbody>{cells}</tbody></table>'
            f'<table class="facts"><tbody>{used}</tbody></table>{extra}'
            f'<h2>Timeline</h2>{timeline(row)}{steps}')


# --- dumps ---------------------------------------------------------------------------------


def dumps(listed: list[dict] | None, total: int, page: int) -> str:
    if listed is None:
        return not_configured("Dumps", "the dump plugin is not in the pipeline")
    if not listed:
        return notice("No dumps.")
    rows = [[link("/console/dump", d["name"], name=d["name"]), e(d["day"]), e(d["time"]),
             link("/console/exchange", d["request_id"], id=d["request_id"]), str(d["size"])]
            for d in listed]
    pages = (total + record.PAGE - 1) // record.PAGE
    return (f'<p class="muted">{total} dumps.</p>'
            + table(["Dump", "Day", "Time (UTC)", "Exchange", "Bytes"], rows, frozenset({4}))
            + pager("/console/dumps", page, pages, {}))


def _pretty(value: Any, limit: int = BLOCK_CHARS) -> str:
    text = document.pretty(value)
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n… ({len(text) - limit} more characters)"


def payload(body: Any, where: tuple[int, int | None] | None) -> tuple[str, bool]:
    """The rejected request's messages, the one the error names (and its block) marked; far
    from it, a message is one line. Drawn from the one it names outwards (from the first,
    when it names none) while they fit in the page's bounds; returns the markup and whether
    any message or block was left out."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        return f'<pre tabindex="0">{e(_pretty(body))}</pre>', False
    if not messages:
        return notice("No messages."), False
    target = where[0] if where else None
    centre = min(target, len(messages) - 1) if target is not None else 0
    drawn: dict[int, str] = {}
    spent = 0
    cut = False
    for n in _outwards(centre, len(messages)):
        if len(drawn) == MESSAGES_SHOWN:
            break
        part, short = _message(n, messages[n], target, where)
        if drawn and spent + len(part) > PAYLOAD_CHARS:
            break
        drawn[n] = part
        spent += len(part)
        cut = cut or short
    first, last = min(drawn), max(drawn)
    parts = [drawn[n] for n in range(first, last + 1)]
    if first:
        parts.insert(0, _left_out(0, first))
    if last + 1 < len(messages):
        parts.append(_left_out(last + 1, len(messages)))
    return "".join(parts), cut or first > 0 or last + 1 < len(messages)


def _outwards(centre: int, count: int):
    """``centre``, then the indexes below ``count`` ever farther from it, the one before first."""
    yield centre
    for distance in range(1, count):
        if distance > centre and centre + distance >= count:
            return
        if centre - distance >= 0:
            yield centre - distance
        if centre + distance < count:
            yield centre + distance


def _left_out(first: int, end: int) -> str:
    span = f"messages.{first}" if end - first == 1 else f"messages.{first} to messages.{end - 1}"
    return (f'<div class="message muted">{span}: {end - first:,} not drawn here (the raw file '
            f'holds them)</div>')


def _message(n: int, message: Any, target: int | None,
             where: tuple[int, int | None] | None) -> tuple[str, bool]:
    """One message of the payload, and whether blocks of it were left out."""
    role = message.get("role") if isinstance(message, dict) else None
    if target is not None and abs(n - target) > AROUND:
        content = message.get("content") if isinstance(message, dict) else None
        kinds = ([b.get("type") for b in content[:KINDS_SHOWN] if isinstance(b, dict)]
                 if isinstance(content, list) else ["text"])
        more = (f" and {len(content) - KINDS_SHOWN:,} more" if isinstance(content, list)
                and len(content) > KINDS_SHOWN else "")
        return (f'<div class="message muted">messages.{n} {e(role)}: '
                f'{e(", ".join(map(str, kinds)))}{more}</div>'), False
    content = message.get("content") if isinstance(message, dict) else message
    blocks = content if isinstance(content, list) else [content]
    # The blocks around the one the error names, else the first.
    named = where[1] if where is not None and n == target and where[1] is not None else 0
    start = max(0, min(named - BLOCKS_SHOWN // 2, len(blocks) - BLOCKS_SHOWN))
    shown_blocks = range(start, min(start + BLOCKS_SHOWN, len(blocks)))
    inner = []
    if start:
        inner.append(f'<div class="muted">content.0 to content.{start - 1}: not drawn here</div>')
    for k in shown_blocks:
        hit = n == target and (where is None or where[1] is None or where[1] == k)
        mark = ' offending" id="offending' if hit else ""
        label = f"messages.{n}.content.{k}" if isinstance(content, list) else f"messages.{n}"
        inner.append(f'<div class="block{mark}"><div>{"<mark>" if hit else ""}{e(label)}'
                     f'{" ← the error names this" if hit else ""}{"</mark>" if hit else ""}'
                     f'</div><pre tabindex="0">{e(_pretty(blocks[k]))}</pre></div>')
    if shown_blocks.stop < len(blocks):
        inner.append(f'<div class="muted">content.{shown_blocks.stop} to content.'
                     f'{len(blocks) - 1}: not drawn here</div>')
    return (f'<div class="message"><b>messages.{n}</b> {e(role)}{"".join(inner)}</div>',
            len(shown_blocks) < len(blocks))


def side_by_side(before: str, after: str) -> tuple[str, bool]:
    """Two columns, the dumped and the rebuilt, lines that differ marked; long runs of equal
    lines are cut to a little context. At most DIFF_SHOWN lines a side are drawn, each at
    most LINE_CHARS long; returns the markup and whether that left something out."""
    old, new = before.splitlines(), after.splitlines()
    left: list[str] = []
    right: list[str] = []
    room = DIFF_SHOWN
    cut = False
    for tag, i1, i2, j1, j2 in _opcodes(old, new):
        if room <= 0:
            cut = True
            break
        if tag == "equal":
            run = old[i1:i2]
            if len(run) > COLLAPSE:
                gap = f"… {len(run) - 2 * DIFF_CONTEXT} equal lines"
                run = run[:DIFF_CONTEXT] + [gap] + run[-DIFF_CONTEXT:]
            cut = cut or len(run) > room
            run = run[:room]
            room -= len(run)
            text = "".join(f"{e(_line(line))}\n" for line in run)
            left.append(text)
            right.append(text)
            continue
        gone, came = old[i1:min(i2, i1 + room)], new[j1:min(j2, j1 + room)]
        cut = cut or len(gone) < i2 - i1 or len(came) < j2 - j1
        room -= max(len(gone), len(came))
        left.append("".join(f'<span class="del">{e(_line(line))}</span>' for line in gone))
        right.append("".join(f'<span class="add">{e(_line(line))}</span>' for line in came))
        pad = len(came) - len(gone)
        (left if pad > 0 else right).append("\n" * abs(pad))
    if cut:
        rest = f"… the rest, past {DIFF_SHOWN:,} lines, is not drawn here (the raw file holds it)\n"
        left.append(rest)
        right.append(rest)
    return (f'<div class="diff"><div><h3>dumped</h3><pre tabindex="0">{"".join(left)}</pre></div>'
            f'<div><h3>replayed</h3><pre tabindex="0">{"".join(right)}</pre></div></div>', cut)


def _line(text: str) -> str:
    if len(text) <= LINE_CHARS:
        return text
    return f"{text[:LINE_CHARS]}… ({len(text) - LINE_CHARS:,} more characters)"


def _opcodes(old: list[str], new: list[str]) -> list[tuple[str, int, int, int, int]]:
    """difflib's opcodes, the head and tail both sides share found without it."""
    shorter = min(len(old), len(new))
    head = 0
    while head < shorter and old[head] == new[head]:
        head += 1
    tail = 0
    while tail < shorter - head and old[-1 - tail] == new[-1 - tail]:
        tail += 1
    end_old, end_new = len(old) - tail, len(new) - tail
    codes = [("equal", 0, head, 0, head)] if head else []
    if end_old - head > DIFF_LINES or end_new - head > DIFF_LINES:
        codes.append(("replace", head, end_old, head, end_new))
    else:
        matcher = difflib.SequenceMatcher(None, old[head:end_old], new[head:end_new],
                                          autojunk=False)
        codes += [(tag, i1 + head, i2 + head, j1 + head, j2 + head)
                  for tag, i1, i2, j1, j2 in matcher.get_opcodes()]
    if tail:
        codes.append(("equal", end_old, len(old), end_new, len(new)))
    return codes


def _part(doc: dict, name: str) -> dict:
    """A section of a dump, which is data anyone who could write the file may have made: a
    section that is no mapping is drawn as an empty one (the replay names what is wrong)."""
    value = doc.get(name)
    return value if isinstance(value, dict) else {}


def raw_link(name: str, text: str = "the raw file") -> str:
    return link("/console/dump/raw", text, name=name)


def dump(name: str, doc: dict | None, error: str | None, replayed, raw: bool = True) -> str:
    """One dump's page; ``raw``: whether ``name`` names a file the raw link may serve."""
    if doc is None:
        return notice(f"{name}: {error}", bad=True) + (
            f"<p>Download {raw_link(name)}.</p>" if raw else "")
    message = record.error_message(doc)
    where = record.offending(message)
    facts = [("request", link("/console/exchange", doc.get("request_id"),
                              id=doc.get("request_id"))),
             ("written", e(doc.get("time"))), ("reason", e(doc.get("reason"))),
             ("outcome", e(doc.get("outcome"))),
             ("backend", e(_part(doc, "backend").get("name"))),
             ("error", f'<span class="bad" id="error-message">{e(message)}</span>'),
             ("file", raw_link(name, "download"))]
    cells = "".join(f"<tr><th scope=row>{e(k)}</th><td>{v}</td></tr>" for k, v in facts)
    steps = _part(doc, "timeline").get("steps")
    steps = steps if isinstance(steps, list) else []
    attempts = doc.get("attempts")
    attempts = attempts if isinstance(attempts, list) else []
    row = {"endpoint": doc.get("endpoint"), "timeline": steps,
           "attempts": [{"backend": a.get("backend"), "credential": a.get("credential"),
                         "status": a.get("status"), "wait_ms": a.get("wait_ms")}
                        for a in attempts if isinstance(a, dict)],
           "status": _part(doc, "upstream_response").get("status")
           or _part(doc, "relay_error").get("status"), "outcome": doc.get("outcome"),
           "model": None}
    translation = _part(doc, "translation")
    table_rows = [[f"<code>{e(k)}</code>", f"<code>{e(shown(v))}</code>"]
                  for k, v in list(translation.items())[:TRANSLATION_ROWS]]
    drawn, cut = payload(record.rejected_body(doc), where)
    cut = (cut or len(translation) > TRANSLATION_ROWS or len(steps) > TIMELINE_STEPS
           or len(attempts) > TIMELINE_STEPS)
    parts = [f'<table class="facts"><tbody>{cells}</tbody></table>', "<h2>Timeline</h2>",
             timeline(row), "<h2>The rejected request</h2>", drawn,
             "<h2>Translation table</h2>",
             table(["Id", "Entry"], table_rows) if table_rows else notice("Empty."),
             "<h2>Replay</h2>"]
    if len(translation) > TRANSLATION_ROWS:
        parts.insert(-1, notice(f"The first {TRANSLATION_ROWS} of {len(translation):,} ids."))
    if isinstance(replayed, str):
        parts.append(notice(replayed, bad=True))
    else:
        recorded, rebuilt = replayed
        before, after = recorded.comparable(), rebuilt.comparable()
        texts = {k: (document.pretty(before[k], sort_keys=True),
                     document.pretty(after[k], sort_keys=True)) for k in before}
        same = all(old == new for old, new in texts.values())
        parts.append(notice("The rebuilt request is identical to the dumped one." if same else
                            "The rebuilt request differs from the dumped one.", bad=not same))
        part = "relay error" if rebuilt.relay_error is not None else "upstream-bound body"
        parts.append(f"<p>The {e(part)}, as the dump recorded it and as the relay's request "
                     f"chain rebuilds it now (<code>relay replay</code>):</p>")
        diff, diff_cut = side_by_side(*texts[part])
        parts.append(diff)
        cut = cut or diff_cut
    if cut:
        parts.insert(0, f'<p class="notice" role="status" id="truncated">This dump is larger '
                        f'than one page draws: parts of it are left out below, each where it '
                        f'would be. Truncated; download {raw_link(name)} for all of it.</p>')
    return "".join(parts)


# --- backends ------------------------------------------------------------------------------


def backends(health: list[dict], configured: list) -> str:
    rows = []
    for item in health:
        state = str(item.get("state"))
        since = when(item.get("since")) if item.get("since") else ""
        until = when(item.get("until")) if item.get("until") else ""
        statuses = item.get("recent") or []
        rows.append([e(item.get("backend")), e(item.get("credential") or "-"),
                     f'<span class="{"good" if state == "healthy" else "bad"}">{e(state)}</span>',
                     until, since, e(item.get("reason") or ""),
                     e(" ".join(map(str, list(statuses)[:20]))),
                     "<br>".join(_limit_used(limit) for limit in item.get("limits") or ())])
    pooled = {item.get("backend") for item in health}
    for backend in configured:
        if backend.name not in pooled:
            rows.append([e(backend.name), "-", '<span class="muted">one key: no pool</span>',
                         "", "", "", "", ""])
    return table(["Backend", "Credential", "State", "Cooling until", "Since", "Reason",
                  "Recent statuses (newest first)", "Own limits (used of)"], rows)


def _limit_used(limit: dict) -> str:
    scope = f" ({limit['models']})" if limit.get("models") else ""
    used, of = limit.get("used", 0), limit.get("of", 0)
    if limit.get("limit") == "budget":
        return e(f"budget{scope} ${used / 1e6:,.2f} of ${of / 1e6:,.2f}")
    return e(f"{limit.get('limit')}{scope} {used} of {of}")
