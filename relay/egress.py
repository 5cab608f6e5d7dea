"""The HTTP(S) proxy a backend is reached through, decided once when the config loads.

A backend's ``proxy:`` names one (or ``none``); without it, the standard environment
variables do, as curl and Python's urllib read them: ``https_proxy`` / ``HTTPS_PROXY`` for an
``https://`` backend, ``http_proxy`` / ``HTTP_PROXY`` for an ``http://`` one (the lowercase
name first when both are set), and ``no_proxy`` / ``NO_PROXY`` naming the hosts reached
directly. aiohttp reads them itself only with ``trust_env``, which also sends ``~/.netrc``
credentials and reads the environment again on every request: the relay never sets it.

How ``NO_PROXY`` is read, there being no standard (GitLab's survey, about.gitlab.com/blog/
we-need-to-talk-no-proxy, 2021, compares the clients), is what they share:

- entries separated by commas (curl, urllib, requests, Go) or white space (libwww's original
  syntax; Claude Code's code.claude.com/docs/en/network-config shows both), case-insensitive;
- ``*`` alone: every host direct (curl's CURLOPT_NOPROXY, urllib, Go, httpx);
- a name matches itself and every host under it, at a label boundary: ``example.com`` and
  ``.example.com`` (and ``*.example.com``) match ``example.com`` and ``api.example.com``,
  never ``notexample.com`` (curl.se/libcurl/c/CURLOPT_NOPROXY.html: "ample.com would match
  ample.com ... and www.ample.com, but not www.example.com"; urllib's
  ``proxy_bypass_environment`` strips the leading dot the same);
- an IP address matches that address, a CIDR block (``10.0.0.0/8``, curl 7.86+, requests,
  Go) every address in it; IPv6 with or without brackets; names never match an IP literal;
- ``host:port`` matches that port only (urllib, requests, Go).

Unlike Go, loopback is not exempt by itself: curl, urllib, requests and httpx proxy
``127.0.0.1`` too unless ``NO_PROXY`` names it, and so does the relay.
"""

from __future__ import annotations

import base64
import ipaddress
import re
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from .errors import ConfigError

# For each backend URL scheme, the variables naming its proxy, in the order they are read.
ENVIRONMENT = {"https": ("https_proxy", "HTTPS_PROXY"), "http": ("http_proxy", "HTTP_PROXY")}
NO_PROXY = ("no_proxy", "NO_PROXY")
DIRECT = "none"
_SEPARATORS = re.compile(r"[,\s]+")


@dataclass(frozen=True)
class Proxy:
    """A backend's proxy: ``url`` is ``scheme://host:port`` without credentials (what the
    start-up line and error messages may show); ``authorization`` is the
    ``Proxy-Authorization`` value its ``user:password@`` makes, never shown."""

    url: str
    host: str
    port: int
    source: str  # the relay.yaml key or the environment variable it came from
    authorization: str | None = field(default=None, repr=False)


def parse(value: str, where: str, source: str | None = None) -> Proxy:
    """A proxy URL: ``http://`` or ``https://``, a host, an optional port (the scheme's by
    default) and ``user:password@``, nothing else. A ConfigError names ``where`` and what is
    wrong, never the value, which may hold a password; ``source`` (by default ``where``) is
    what the proxy's record says it came from."""
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError:  # its words may quote the value
        raise ConfigError(f"{where}: not a valid proxy URL: a port that is not a number from "
                          f"0 to 65535, or a broken [IPv6] address") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise ConfigError(f"{where}: the proxy must be an http:// or https:// URL"
                          + (f", not {scheme}://" if scheme else ""))
    if not parts.hostname:
        raise ConfigError(f"{where}: the proxy URL has no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"{where}: a proxy URL is scheme://[user:password@]host[:port], "
                          f"without a path, query or fragment")
    host = parts.hostname
    if port is None:
        port = 443 if scheme == "https" else 80
    shown = f"[{host}]" if ":" in host else host
    authorization = None
    if parts.username is not None or parts.password is not None:
        credentials = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
        authorization = "Basic " + base64.b64encode(credentials.encode()).decode("ascii")
    return Proxy(f"{scheme}://{shown}:{port}", host, port, source or where, authorization)


def configured(value, where: str) -> Proxy | None:
    """The ``proxy:`` key of a backend: a URL, or ``none`` / null for a direct connection."""
    if value is None or (isinstance(value, str) and value.strip().lower() == DIRECT):
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{where}: must be a proxy URL (http:// or https://) or {DIRECT}")
    try:
        return parse(value, where)
    except ConfigError as e:
        raise ConfigError(f"{e} (or {DIRECT} to go direct)") from None


def from_environment(url: str, env, path: str) -> Proxy | None:
    """The proxy the environment names for the backend at ``path`` (``url``), or None: no
    variable for its scheme, an empty one, or ``NO_PROXY`` naming its host. A value without a
    scheme is an ``http://`` proxy's address, as curl and urllib take it."""
    parts = urlsplit(url)
    value = None
    for name in ENVIRONMENT.get(parts.scheme, ()):
        if name in env:
            value = env[name]
            break
    if not value or not value.strip():
        return None
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    no_proxy = next((env[name] for name in NO_PROXY if name in env), "")
    if bypassed(host, port, no_proxy):
        return None
    value = value.strip()
    try:
        return parse(value if "://" in value else "http://" + value, f"{path}: {name}", name)
    except ConfigError as e:
        raise ConfigError(f"{e} (set {path}.proxy: {DIRECT} to go direct)") from None


def bypassed(host: str, port: int, no_proxy: str) -> bool:
    """Whether ``NO_PROXY`` (``no_proxy``) sends ``host:port`` direct (see the module)."""
    host = host.lower().rstrip(".")
    try:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address | None = \
            ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        address = None
    for entry in _SEPARATORS.split(no_proxy.lower()):
        if entry == "*":
            return True
        name, wanted = _split_port(entry)
        if not name or (wanted is not None and wanted != port):
            continue
        if address is not None:
            if _address_matches(address, name):
                return True
            continue
        name = name.lstrip("*").lstrip(".").rstrip(".")
        if name and (host == name or host.endswith("." + name)):
            return True
    return False


def _split_port(entry: str) -> tuple[str, int | None]:
    """An entry's host and port: ``[::1]:8080``, ``host:8080``; a bare IPv6 address has more
    than one colon and no port. A port that is not a number leaves an entry matching nothing."""
    if entry.startswith("["):
        name, _, rest = entry[1:].partition("]")
        if rest.startswith(":"):
            return (name, int(rest[1:])) if rest[1:].isdigit() else ("", None)
        return name, None
    if entry.count(":") == 1:
        name, _, port = entry.partition(":")
        return (name, int(port)) if port.isdigit() else ("", None)
    return entry, None


def _address_matches(address, name: str) -> bool:
    try:
        if "/" in name:
            return address in ipaddress.ip_network(name, strict=False)
        return address == ipaddress.ip_address(name)
    except ValueError:  # a name, which never matches an address
        return False
