"""Traces: relay.yaml's ``telemetry:`` section, and the switch that turns them on.

Off unless ``telemetry.otlp_endpoint`` is set, and then the relay neither imports
OpenTelemetry nor does anything per request for it. When it is set, each serving process
(each worker, after the fork) starts its own tracer provider (:mod:`relay.otel`, which needs
the ``telemetry`` extra: ``pip install 'messages-relay[telemetry]'``) and turns every
finished exchange into a trace, built from the record at the exchange's end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from .errors import ConfigError
from .exchange import is_credential_header
from .options import Option

if TYPE_CHECKING:
    from .otel import Traces

# The OTLP/HTTP path for traces, under a collector's base URL (the OTLP specification's
# default: opentelemetry.io/docs/specs/otlp/#otlphttp-request).
TRACES_PATH = "/v1/traces"


def _endpoint(value) -> str | None:
    if value == "":
        return None
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return "must be an http:// or https:// URL (the collector's OTLP/HTTP address)"
    return None


def _headers(value, path: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: must be a mapping of header name to value")
    for name, text in value.items():
        if not isinstance(name, str) or not isinstance(text, str):
            raise ConfigError(f"{path}.{name}: must be a string")
        # relay.yaml holds no secret: a collector's token comes from the environment.
        if is_credential_header(name):
            raise ConfigError(f"{path}.{name}: a credential is never written in relay.yaml: "
                              f"name an environment variable holding it in headers_env")
    return dict(value)


def _variable(value) -> str | None:
    return None if value == "" or value.replace("_", "").isalnum() \
        else "must be an environment variable name"


OPTIONS = (
    Option("otlp_endpoint", str, "", "the collector's OTLP/HTTP base URL "
           "(`http://127.0.0.1:4318`); traces go to its `/v1/traces`. Empty: no traces",
           check=_endpoint),
    Option("service_name", str, "relay", "the `service.name` the traces carry",
           check=lambda value: None if value else "must be a non-empty string"),
    Option("headers", dict, {}, "headers sent with each export (never a credential: see "
           "`headers_env`)", parse=_headers),
    Option("headers_env", str, "", "an environment variable holding more headers, as "
           "`name=value,name=value` (OpenTelemetry's own format): the collector's token",
           check=_variable),
    Option("timeout", float, 10.0, "seconds one export may take (in the exporter's own "
           "thread: the relay never waits for it)",
           check=lambda value: None if value > 0 else "must be a positive number"),
)


def configured(section: dict) -> bool:
    """Whether relay.yaml's checked ``telemetry:`` section asks for traces."""
    return bool(section.get("otlp_endpoint"))


def traces_url(endpoint: str) -> str:
    """Where the exporter posts: the base URL's ``/v1/traces``, unless the URL names it."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(TRACES_PATH) else endpoint + TRACES_PATH


def start(section: dict, env) -> Traces:
    """This process's exporter of traces (imports OpenTelemetry: only when configured)."""
    try:
        from .otel import Traces
    except ImportError as e:
        raise ConfigError(f"telemetry.otlp_endpoint: traces need OpenTelemetry's SDK and "
                          f"OTLP exporter: pip install 'messages-relay[telemetry]' ({e})") \
            from None
    return Traces(section, env)
