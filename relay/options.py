"""Plugin options, declared: each key's type, default, help, choices, and whether a backend's
``quirks:`` may set it.

A plugin declares them as ``OPTIONS = (Option(...), ...)`` (a module or class attribute). The
host checks ``plugins.<name>`` and every backend's ``quirks:`` against the declarations at
start-up: an unknown key is an error that names its key path and the closest known name, and
a value of the wrong type or outside its choices is an error too. A plugin then sees its own
options, defaults filled in, overlaid with the quirks it declared, and nothing else.

A plugin that declares nothing gets its section and every quirk as they are, unchecked (and
then quirks cannot be checked either, since any of them may be its own).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable

from .errors import ConfigError

_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
          list: "a list", dict: "a mapping"}


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of a plugin. ``check`` returns what is wrong with a value (``"must be a
    non-empty string"``), or None; it runs after the type and choices checks."""

    name: str
    kind: type | tuple
    default: Any
    help: str
    choices: tuple = ()
    quirk: bool = False
    check: Callable[[Any], str | None] | None = None

    def validate(self, value, path: str):
        kinds = self.kind if isinstance(self.kind, tuple) else (self.kind,)
        if value is None and self.default is None:
            return value
        if self.choices and (isinstance(value, bool) or value not in self.choices):
            raise ConfigError(f"{path}: must be one of {', '.join(map(str, self.choices))}, "
                              f"not {value!r}")
        wrong_bool = isinstance(value, bool) and bool not in kinds
        if wrong_bool or not isinstance(value, kinds):
            if float in kinds and isinstance(value, int) and not isinstance(value, bool):
                return value
            words = " or ".join(_WORDS.get(kind, kind.__name__) for kind in kinds)
            raise ConfigError(f"{path}: must be {words}, not {value!r}")
        problem = self.check(value) if self.check is not None else None
        if problem:
            raise ConfigError(f"{path}: {problem}")
        return value


def declared(plugin) -> tuple[Option, ...] | None:
    options = getattr(plugin, "OPTIONS", None)
    return tuple(options) if options is not None else None


def _unknown(path: str, key, known) -> ConfigError:
    close = (difflib.get_close_matches(str(key), sorted(known), n=1)
             or sorted(name for name in known if str(key) in name)[:1])
    hint = f" (did you mean {close[0]}?)" if close else ""
    choices = f"; known: {', '.join(sorted(known))}" if known and not close else ""
    return ConfigError(f"{path}.{key}: unknown option{hint}{choices}")


def resolve(config, plugins: dict, elsewhere: Callable[[], set] = set) -> tuple[dict, dict]:
    """Check every plugin section and backend quirk against the declarations of ``plugins``
    (name to plugin object, the pipeline's); return the options each plugin sees: ``(base,
    per_backend)``, ``base[name]`` without quirks and ``per_backend[backend][name]`` with.
    ``elsewhere()`` names the quirks that plugins outside the pipeline declare: one of those
    is not a mistake, only unused here."""
    declarations = {name: declared(plugin) for name, plugin in plugins.items()}
    base: dict[str, dict] = {}
    for name, options in declarations.items():
        section = config.plugins.get(name, {})
        if options is None:
            base[name] = dict(section)
            continue
        by_name = {option.name: option for option in options}
        for key in section:
            if key not in by_name:
                raise _unknown(f"plugins.{name}", key, by_name)
        base[name] = {option.name: option.validate(section[option.name],
                                                   f"plugins.{name}.{option.name}")
                      if option.name in section else option.default
                      for option in options}
    quirks = {}
    for name, options in declarations.items():
        for option in options or ():
            if option.quirk:
                quirks.setdefault(option.name, []).append((name, option))
    every_declared = all(options is not None for options in declarations.values())
    per_backend: dict[str, dict[str, dict]] = {}
    for i, backend in enumerate(config.backends):
        for key, value in backend.quirks.items():
            path = f"backends[{i}].quirks.{key}"
            if key not in quirks:
                if every_declared and key not in elsewhere():
                    error = _unknown(f"backends[{i}].quirks", key, quirks)
                    raise ConfigError(str(error).replace("unknown option", "unknown quirk"))
                continue
            for _, option in quirks[key]:
                option.validate(value, path)
        per_backend[backend.name] = {
            name: ({**base[name], **backend.quirks} if options is None else
                   {**base[name], **{option.name: backend.quirks[option.name]
                                     for option in options
                                     if option.quirk and option.name in backend.quirks}})
            for name, options in declarations.items()}
    return base, per_backend


def markdown_table(options: tuple[Option, ...]) -> str:
    """The docs' table of a plugin's options, made from its declarations."""
    rows = ["| key | default | values | quirk | meaning |", "|---|---|---|---|---|"]
    for option in options:
        kinds = option.kind if isinstance(option.kind, tuple) else (option.kind,)
        values = (" / ".join(f"`{choice}`" for choice in option.choices) if option.choices
                  else " or ".join(_WORDS.get(kind, kind.__name__) for kind in kinds))
        default = "(required)" if option.default is None else f"`{_yaml(option.default)}`"
        rows.append(f"| `{option.name}` | {default} | {values} | "
                    f"{'yes' if option.quirk else 'no'} | {option.help} |")
    return "\n".join(rows)


def _yaml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return '""'
    if isinstance(value, list):
        return "[" + ", ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in value) + "]"
    return str(value)
