"""Betas per backend: the ``allow_betas`` / ``drop_betas`` quirks.

Some Anthropic-compatible backends refuse any beta they do not know, and Claude Code sends
several on every request: ``Unexpected value(s) ... for the anthropic-beta header``
(anthropics/claude-code#46105, #70563; new-api #2975, #3041). A backend's quirks name which
betas go to it (``allow_betas``: only these) and which never do (``drop_betas``), as
``fnmatch`` patterns. A dropped beta leaves the ``anthropic-beta`` header (the header goes
when nothing is left), and so do the request fields that only mean something with it: sent
without their beta, they would be refused in its place.

:data:`BODY_FIELDS` and :data:`TOOL_TYPES` are what a beta carries in a request body, read
from the ``anthropic`` SDK's types (``types/beta/message_create_params.py``, the
``types/beta/beta_*_param.py`` tool types, whose date is the beta's). Kept to the betas whose
field is the beta's alone; the relay's list of betas for its history rules is another
matter, and lives elsewhere.
"""

from __future__ import annotations

import fnmatch

import orjson

QUIRKS = ("allow_betas", "drop_betas")

# Top-level request fields, by beta name pattern.
BODY_FIELDS = {
    "context-management-*": ("context_management",),  # BetaContextManagementConfigParam
    "mcp-client-*": ("mcp_servers",),  # BetaRequestMCPServerURLDefinitionParam
    "cache-diagnosis-*": ("diagnostics",),  # BetaDiagnosticsParam
    "fast-mode-*": ("speed",),  # "Some models require the fast-mode-2026-02-01 beta ..."
}
# Tool definitions (``tools[].type``), by beta name.
TOOL_TYPES = {
    "computer-use-2024-10-22": ("computer_20241022",),
    "computer-use-2025-01-24": ("computer_20250124",),
    "computer-use-2025-11-24": ("computer_20251124",),
    "code-execution-2025-05-22": ("code_execution_20250522",),
    "code-execution-2025-08-25": ("code_execution_20250825",),
}


def configured(quirks: dict) -> bool:
    return "allow_betas" in quirks or "drop_betas" in quirks


def kept(beta: str, quirks: dict) -> bool:
    allow = quirks.get("allow_betas")
    if allow is not None and not any(fnmatch.fnmatchcase(beta, p) for p in allow):
        return False
    return not any(fnmatch.fnmatchcase(beta, p) for p in quirks.get("drop_betas", ()))


def filter_header(headers, quirks: dict) -> list[str]:
    """Filter ``anthropic-beta`` in ``headers`` (in place) by the backend's quirks; the betas
    dropped, in the order they came."""
    values = headers.getall("anthropic-beta", ())
    if not values:
        return []
    betas = [beta.strip() for value in values for beta in value.split(",") if beta.strip()]
    keep = [beta for beta in betas if kept(beta, quirks)]
    if len(keep) == len(betas):
        return []
    headers.popall("anthropic-beta")
    if keep:
        headers["anthropic-beta"] = ",".join(keep)
    return [beta for beta in betas if beta not in keep]


def strip_body(body: bytes, dropped: list[str]) -> tuple[bytes, list[str]]:
    """``body`` without the fields and tool definitions of the ``dropped`` betas, and what
    was removed (``tools[computer_20250124]`` for a tool); the bytes as they were when
    nothing was."""
    fields = {name for beta in dropped for pattern, names in BODY_FIELDS.items()
              if fnmatch.fnmatchcase(beta, pattern) for name in names}
    tool_types = {kind for beta in dropped for kind in TOOL_TYPES.get(beta, ())}
    if not fields and not tool_types:
        return body, []
    # Cheap before a parse: a field's name, or a tool type, must be in the bytes at all.
    if not any(name.encode() in body for name in (*fields, *tool_types)):
        return body, []
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body, []
    if type(doc) is not dict:
        return body, []
    removed = [name for name in sorted(fields) if doc.pop(name, None) is not None]
    tools = doc.get("tools")
    if tool_types and type(tools) is list:
        left = [tool for tool in tools if not (type(tool) is dict
                                                and tool.get("type") in tool_types)]
        removed += [f"tools[{tool['type']}]" for tool in tools if type(tool) is dict
                    and tool.get("type") in tool_types]
        if len(left) != len(tools):
            if left:
                doc["tools"] = left
            else:
                doc.pop("tools")
                doc.pop("tool_choice", None)  # the API refuses a tool_choice without tools
    if not removed:
        return body, []
    return orjson.dumps(doc), removed
