"""The betas and top-level request fields the relay knows, and what each means for its
history rules (``pairing``, ``ordering``, ``dedup``'s checks).

The rules are the API's, learned from evidence (``docs/evidence/rules.json``). A beta or a field
can change what a valid history is (compaction blocks that stand for the messages they
summarise, system messages that clear or carry settings, tools defined inside ``messages``);
where the rules have no evidence about one, a refusal could be a false positive, the worst
bug a relay can have. So each beta and field the relay has looked at is classified here,
and a request that carries one the rules do not know, or one that reshapes histories, is
forwarded as it is, with a note: the upstream judges.

``test_betas.py`` compares :data:`BETAS` with the betas the installed ``anthropic`` SDK
declares (``AnthropicBetaParam``) and :data:`FIELDS` with its ``MessageCreateParams``, so a new
SDK release fails the suite until someone has decided what its additions mean. What each
decision rests on is in ``docs/evidence/betas.json``, beside the rules' own evidence.
"""

from __future__ import annotations

# What a beta or a field means for the history rules:
NONE = "none"  # nothing in ``messages`` changes: the rules judge as usual
KNOWN = "known"  # the blocks it brings are ones the rules already tell apart (server tools)
THREADS = "threads"  # server-held threads: judged as tails (see relay.threads)
DEFER = "defer"  # it reshapes histories in ways the rules hold no evidence about: they defer

BETAS = {
    # Output, context and model limits, speed, billing: nothing about a history's shape.
    "output-128k-2025-02-19": NONE,
    "output-300k-2026-03-24": NONE,
    "context-1m-2025-08-07": NONE,
    "model-context-window-exceeded-2025-08-26": NONE,
    "fast-mode-2026-02-01": NONE,
    "thinking-token-count-2026-05-13": NONE,
    "task-budgets-2026-03-13": NONE,
    "token-efficient-tools-2025-02-19": NONE,
    "fine-grained-tool-streaming-2025-05-14": NONE,  # not in the SDK's list; clients send it
    "structured-outputs-2025-11-13": NONE,
    "prompt-caching-2024-07-31": NONE,
    "extended-cache-ttl-2025-04-11": NONE,
    "cache-diagnosis-2026-04-07": NONE,
    "pdfs-2024-09-25": NONE,
    "files-api-2025-04-14": NONE,
    "token-counting-2024-11-01": NONE,
    "message-batches-2024-09-24": NONE,
    "server-side-fallback-2026-06-01": NONE,
    "server-side-fallback-2026-07-01": NONE,
    "fallback-credit-2026-06-01": NONE,
    "fallback-credit-2026-07-01": NONE,
    "skills-2025-10-02": NONE,
    "agent-memory-2026-07-22": NONE,
    "context-management-2025-06-27": NONE,
    "interleaved-thinking-2025-05-14": NONE,
    "dev-full-thinking-2025-05-14": NONE,
    # Client tools of a known shape (tool_use / tool_result).
    "computer-use-2024-10-22": NONE,
    "computer-use-2025-01-24": NONE,
    "computer-use-2025-11-24": NONE,
    # Server tools: their blocks sit in the assistant turn and take no client tool_result.
    "code-execution-2025-05-22": KNOWN,
    "advisor-tool-2026-03-01": KNOWN,
    "mcp-client-2025-04-04": KNOWN,
    "mcp-client-2025-11-20": KNOWN,
    # Not the Messages API at all (organisations, agents, tunnels, webhooks, analytics...).
    "user-profiles-2026-03-24": NONE,
    "user-profiles-2026-08-18": NONE,
    "user-profiles-2026-09-04": NONE,
    "user-profiles-billing-2026-10-01": NONE,
    "managed-agents-2026-04-01": NONE,
    "dreaming-2026-04-21": NONE,
    "mcp-tunnels-2026-06-22": NONE,
    "ce-plugins-2026-09-01": NONE,
    "ce-user-management-2026-07-13": NONE,
    "ce-claude-code-managed-settings-2026-10-06": NONE,
    "spend-limit-reads-2026-09-26": NONE,
    "telemetry-destinations-2026-08-11": NONE,
    "webhooks-2026-10-07": NONE,
    "admin-user-sign-out-2026-10-08": NONE,
    "analytics-usage-cost-2026-08-24": NONE,
    "experimental-claude-tag-2026-10-21": NONE,
    "efs-2026-10-01": NONE,
    "google-managed-data-controls-2026-09-01": NONE,
    "message-threads-2026-08-12": THREADS,
    # Claude Code (2.1.332) sends these on every request of its main loop, with the next two
    # and mid-conversation-tool-changes; the rules' evidence from Claude Code sessions was
    # gathered under them.
    "claude-code-20250219": NONE,
    "effort-2025-11-24": NONE,
    "per-turn-control-2026-07-01": NONE,
    "advanced-tool-use-2025-11-20": KNOWN,
    # Tool additions and removals live in role: system messages, whose placement rule comes
    # from Claude Code sessions that carry this beta.
    "mid-conversation-tool-changes-2026-07-01": KNOWN,
    # They put new things into messages, or change what a turn may hold.
    "compact-2026-01-12": DEFER,
    "compact-2026-09-04": DEFER,
    "mid-conversation-system-clear-at-2026-08-21": DEFER,
    "mid-conversation-output-config-2026-07-01": DEFER,
    "thinking-binding-controls-2026-08-01": DEFER,
    "thinking-display-updates-2026-08-18": DEFER,
    "inline-tools-2026-09-15": DEFER,
    "mcp-client-2026-09-15": DEFER,
}

# Top-level fields of a Messages request (the SDK's beta MessageCreateParams, and the older
# sampling fields the API still takes). ``betas`` is the SDK's name for the header, never a
# body field.
FIELDS = {
    "model": NONE, "messages": NONE, "max_tokens": NONE, "stream": NONE, "system": NONE,
    "metadata": NONE, "stop_sequences": NONE, "temperature": NONE, "top_k": NONE,
    "top_p": NONE, "tools": NONE, "tool_choice": NONE, "thinking": NONE,
    "service_tier": NONE, "speed": NONE, "inference_geo": NONE, "output_config": NONE,
    "output_format": NONE, "cache_control": NONE, "diagnostics": NONE, "container": NONE,
    "context_management": NONE, "billing_policy": NONE, "fallbacks": NONE,
    "user_profile_id": NONE, "workspace_id": NONE,
    "mcp_servers": KNOWN,
    "thread": THREADS,
    # A compaction request summarises ``messages``; a retry redeeming a credit token may
    # append one assistant message the model would otherwise refuse as a prefill.
    "compaction": DEFER,
    "fallback_credit_token": DEFER,
}


def requested_betas(headers) -> list[str]:
    """The betas a request names in its ``anthropic-beta`` header(s), comma-separated."""
    getall = getattr(headers, "getall", None)
    values = getall("anthropic-beta", ()) if getall is not None else [
        value for name, value in headers.items() if name.lower() == "anthropic-beta"]
    return [name.strip() for value in values for name in value.split(",") if name.strip()]


def deferring(headers, field_names) -> tuple[tuple[str, str], ...]:
    """``(kind, name)`` for each beta (``"beta"``) and top-level field (``"field"``) of a
    request that the history rules must defer to the upstream for: unknown ones, and those
    classified :data:`DEFER`. Empty for the usual request."""
    found = []
    if headers:
        for name in requested_betas(headers):
            if BETAS.get(name, DEFER) == DEFER:
                found.append(("beta", name))
    for name in field_names:
        if FIELDS.get(name, DEFER) == DEFER:
            found.append(("field", name))
    return tuple(found)


def described(reasons) -> str:
    """The reasons as a timeline entry and a note show them."""
    return ", ".join(f"{kind} {name}" for kind, name in reasons)
