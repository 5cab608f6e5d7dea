"""relay.yaml: loading and validation. Every problem names its key path."""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import yaml

from .errors import ConfigError

MAX_BODY_BYTES = 32 * 1024 * 1024  # the Messages API's own request limit
MAX_WORKERS = 256  # a typo, not a machine: each worker holds its own connections and memory


@dataclass
class Timeouts:
    connect: float = 10.0
    read: float = 600.0  # the longest silence allowed between two upstream chunks
    total: float | None = None


@dataclass
class Backend:
    name: str
    url: str
    models: list[str]
    default: bool = False
    rename: dict[str, str] = field(default_factory=dict)
    api_key_env: str | None = None
    api_key: str | None = None  # read from api_key_env at start-up, never from the file
    auth: str = "x-api-key"
    quirks: dict = field(default_factory=dict)
    timeouts: Timeouts = field(default_factory=Timeouts)

    def serves(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)

    def upstream_model(self, model: str) -> str | None:
        """The model name to send up, when relay.yaml renames this one."""
        for pattern, target in self.rename.items():
            if fnmatch.fnmatchcase(model, pattern):
                return target
        return None


@dataclass
class Config:
    backends: list[Backend]
    pipeline: list[str] = field(default_factory=list)
    plugins: dict[str, dict] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 8787
    max_body_bytes: int = MAX_BODY_BYTES
    upstream_connections: int = 512
    log_level: str = "INFO"
    access_log: bool = False
    log_format: str = "text"
    workers: int = 1
    drain_seconds: float = 30.0
    source: str | None = None
    _routes: dict = field(default_factory=dict, repr=False, compare=False)

    def backend_for(self, model: str) -> Backend | None:
        try:
            return self._routes[model]
        except KeyError:
            pass
        found = next((b for b in self.backends if b.serves(model)), None)
        if found is None:
            found = self.default_backend(fallback=False)
        if len(self._routes) >= 1024:  # model names come from clients: keep the cache bounded
            self._routes.clear()
        self._routes[model] = found
        return found

    def default_backend(self, fallback: bool = True) -> Backend | None:
        for backend in self.backends:
            if backend.default:
                return backend
        return self.backends[0] if fallback else None


def option_sources(config: Config, plugin: str, options: dict):
    """Where a plugin's option may be set, as (key path, mapping): the plugin's own section,
    then each backend's quirks, which override it for that backend. For relay_startup checks."""
    yield f"plugins.{plugin}", options
    for i, backend in enumerate(config.backends):
        yield f"backends[{i}].quirks", backend.quirks


def check_choice(config: Config, plugin: str, options: dict, key: str, choices) -> None:
    """Raise ConfigError, with its key path, where ``key`` is set to a value not in ``choices``."""
    for where, mapping in option_sources(config, plugin, options):
        if key in mapping and mapping[key] not in choices:
            raise ConfigError(f"{where}.{key}: must be one of {', '.join(choices)}, "
                              f"not {mapping[key]!r}")


def load(path: str, env=os.environ, require_keys: bool = True) -> Config:
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    config = parse(raw if raw is not None else {}, env, require_keys)
    config.source = path
    return config


def _expect(value, kind, path: str, what: str):
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{path}: must be {what}")
    return value


def _number(value, path: str, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and value <= 0):
        raise ConfigError(f"{path}: must be a positive number")
    return value


def _unknown(section: dict, known: set, path: str) -> None:
    for key in section:
        if key not in known:
            where = f"{path}.{key}" if path else str(key)
            raise ConfigError(f"{where}: unknown key (expected one of: {', '.join(sorted(known))})")


def parse(raw, env=os.environ, require_keys: bool = True) -> Config:
    """Validate a loaded relay.yaml document and build the :class:`Config`.

    ``require_keys=False`` is for offline tools (validate, replay without --send): a backend
    whose ``api_key_env`` variable is unset then simply has no key.
    """
    _expect(raw, dict, "(top level)", "a mapping")
    _unknown(raw, {"server", "pipeline", "plugins", "backends"}, "")
    config = Config(backends=[])

    server = _expect(raw.get("server", {}) or {}, dict, "server", "a mapping")
    _unknown(server, {"host", "port", "max_body_bytes", "upstream_connections", "log_level",
                      "access_log", "log_format", "workers", "drain_seconds"}, "server")
    config.host = _expect(server.get("host", config.host), str, "server.host", "a string")
    port = _expect(server.get("port", config.port), int, "server.port", "an integer")
    if not 0 <= port <= 65535:
        raise ConfigError("server.port: must be between 0 and 65535")
    config.port = port
    config.max_body_bytes = int(_number(server.get("max_body_bytes", config.max_body_bytes),
                                        "server.max_body_bytes"))
    config.upstream_connections = int(_number(
        server.get("upstream_connections", config.upstream_connections), "server.upstream_connections"))
    level = _expect(server.get("log_level", config.log_level), str, "server.log_level", "a string")
    if level.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        raise ConfigError("server.log_level: must be DEBUG, INFO, WARNING or ERROR")
    config.log_level = level.upper()
    config.access_log = _expect(server.get("access_log", False), bool, "server.access_log",
                                "true or false")
    config.log_format = _expect(server.get("log_format", config.log_format), str,
                                "server.log_format", "text or json")
    if config.log_format not in ("text", "json"):
        raise ConfigError("server.log_format: must be text or json")
    config.workers = _expect(server.get("workers", config.workers), int, "server.workers",
                             "an integer")
    if not 1 <= config.workers <= MAX_WORKERS:
        raise ConfigError(f"server.workers: must be between 1 and {MAX_WORKERS}")
    drain = server.get("drain_seconds", config.drain_seconds)
    if isinstance(drain, bool) or not isinstance(drain, (int, float)) or drain < 0:
        raise ConfigError("server.drain_seconds: must be a number of seconds, 0 or more")
    config.drain_seconds = float(drain)

    pipeline = _expect(raw.get("pipeline", []) or [], list, "pipeline", "a list of plugin names")
    for i, name in enumerate(pipeline):
        _expect(name, str, f"pipeline[{i}]", "a plugin name")
        if name in pipeline[:i]:
            raise ConfigError(f"pipeline[{i}]: {name!r} is listed twice")
    config.pipeline = list(pipeline)

    plugins = _expect(raw.get("plugins", {}) or {}, dict, "plugins", "a mapping of plugin name to options")
    for name, options in plugins.items():
        config.plugins[name] = dict(_expect(options or {}, dict, f"plugins.{name}", "a mapping"))

    backends = raw.get("backends")
    if not backends:
        raise ConfigError("backends: required (at least one backend)")
    _expect(backends, list, "backends", "a list")
    names = set()
    for i, item in enumerate(backends):
        backend = _backend(item, f"backends[{i}]", env, require_keys)
        if backend.name in names:
            raise ConfigError(f"backends[{i}].name: {backend.name!r} is used twice")
        names.add(backend.name)
        config.backends.append(backend)
    if sum(b.default for b in config.backends) > 1:
        raise ConfigError("backends: only one backend may be the default")
    return config


def _backend(item, path: str, env, require_keys: bool) -> Backend:
    _expect(item, dict, path, "a mapping")
    _unknown(item, {"name", "url", "models", "default", "rename", "api_key_env", "auth",
                    "quirks", "timeouts"}, path)
    for key in ("name", "url"):
        if key not in item:
            raise ConfigError(f"{path}.{key}: required")
    name = _expect(item["name"], str, f"{path}.name", "a string")
    url = _expect(item["url"], str, f"{path}.url", "a string").rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{path}.url: must be an http:// or https:// URL, not {url!r}")
    models = item.get("models", [])
    _expect(models, list, f"{path}.models", "a list of model name patterns")
    for j, pattern in enumerate(models):
        _expect(pattern, str, f"{path}.models[{j}]", "a string")
    rename = _expect(item.get("rename", {}) or {}, dict, f"{path}.rename", "a mapping of model to model")
    for key, value in rename.items():
        _expect(value, str, f"{path}.rename.{key}", "a model name")
    backend = Backend(
        name=name, url=url, models=list(models),
        default=_expect(item.get("default", False), bool, f"{path}.default", "true or false"),
        rename={str(k): v for k, v in rename.items()},
        quirks=dict(_expect(item.get("quirks", {}) or {}, dict, f"{path}.quirks", "a mapping")),
    )
    auth = _expect(item.get("auth", "x-api-key"), str, f"{path}.auth", "a string")
    if auth not in ("x-api-key", "bearer"):
        raise ConfigError(f"{path}.auth: must be x-api-key or bearer")
    backend.auth = auth
    if "api_key_env" in item:
        var = _expect(item["api_key_env"], str, f"{path}.api_key_env", "an environment variable name")
        if not env.get(var) and require_keys:
            raise ConfigError(f"{path}.api_key_env: environment variable {var} is not set")
        backend.api_key_env, backend.api_key = var, env.get(var) or None
    timeouts = _expect(item.get("timeouts", {}) or {}, dict, f"{path}.timeouts", "a mapping")
    _unknown(timeouts, {"connect", "read", "total"}, f"{path}.timeouts")
    for key in ("connect", "read", "total"):
        if key in timeouts:
            if key == "total" and timeouts[key] is None:  # null: no limit on a whole exchange
                backend.timeouts.total = None
            else:
                setattr(backend.timeouts, key, _number(timeouts[key], f"{path}.timeouts.{key}"))
    return backend
