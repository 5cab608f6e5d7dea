"""Options, declared: each key's type, default, help, choices, whether it is required, and
whether a backend's ``quirks:`` may set it.

A plugin declares them as ``OPTIONS = (Option(...), ...)`` (a module or class attribute). The
host checks ``plugins.<name>`` and every backend's ``quirks:`` against the declarations at
start-up: an unknown key is an error that names its key path and the closest known name, and
a value of the wrong type or outside its choices is an error too. A plugin then sees its own
options, defaults filled in, overlaid with the quirks it declared, and nothing else.

A plugin that declares nothing gets its section and every quirk as they are, unchecked (and
then quirks cannot be checked either, since any of them may be its own).

The host declares its own keys the same way (``relay.config.SERVER_OPTIONS``) and checks them
with :func:`check_section`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterable
from typing import Any

from .errors import ConfigError

_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
          list: "a list", dict: "a mapping"}


@dataclasses.dataclass(frozen=True)
class Option:
    """One option. A ``required`` one has no default: its key must be there (and a null is
    then of the wrong type, as for any option with a default). ``check`` returns what is
    wrong with a value (``"must be a non-empty string"``), or None; it runs after the type
    and choices checks. ``expect`` words what a value must be when its type or choice is
    wrong (``"a positive number"``), in place of the type's words and the value given.
    ``parse`` is for a value with structure of its own (a list of routes): it checks and
    builds the value, naming paths inside it, in place of the type, choices and check; an
    option that has one gives its default in the file's form, and the default is parsed
    too."""

    name: str
    kind: type | tuple
    default: Any
    help: str
    choices: tuple = ()
    quirk: bool = False
    check: Callable[[Any], str | None] | None = None
    required: bool = False
    expect: str = ""
    parse: Callable[[Any, str], Any] | None = None

    def validate(self, value, path: str):
        if self.parse is not None:
            return self.parse(value, path)
        kinds = self.kind if isinstance(self.kind, tuple) else (self.kind,)
        if value is None and self.default is None and not self.required:
            return value
        if self.choices and (isinstance(value, bool) or value not in self.choices):
            raise ConfigError(f"{path}: must be "
                              + (self.expect or f"one of {', '.join(map(str, self.choices))}, "
                                                f"not {value!r}"))
        wrong_bool = isinstance(value, bool) and bool not in kinds
        widened = float in kinds and isinstance(value, int)
        if wrong_bool or not (isinstance(value, kinds) or widened):
            words = " or ".join(_WORDS.get(kind, kind.__name__) for kind in kinds)
            raise ConfigError(f"{path}: must be {self.expect or f'{words}, not {value!r}'}")
        problem = self.check(value) if self.check is not None else None
        if problem:
            raise ConfigError(f"{path}: {problem}")
        return value

    def initial(self, path: str):
        """The value an absent key takes."""
        if self.parse is not None and self.default is not None:
            return self.parse(self.default, path)
        return self.default


def declared(plugin) -> tuple[Option, ...] | None:
    options = getattr(plugin, "OPTIONS", None)
    return tuple(options) if options is not None else None


def unknown(path: str, key, known: Iterable[str], what: str = "option") -> ConfigError:
    """The error for an unknown ``key`` under ``path``: the closest known name, or all of
    them when none is close."""
    known = sorted(known)
    close = (difflib.get_close_matches(str(key), known, n=1)
             or [name for name in known if str(key) in name][:1])
    where = f"{path}.{key}" if path else str(key)
    if close:
        return ConfigError(f"{where}: unknown {what} (did you mean {close[0]}?)")
    if what == "key":  # the host's own sections have always listed their keys this way
        return ConfigError(f"{where}: unknown key (expected one of: {', '.join(known)})")
    return ConfigError(f"{where}: unknown {what}" + (f"; known: {', '.join(known)}"
                                                     if known else ""))


def check_section(section: dict, options: Iterable[Option], path: str,
                  what: str = "option") -> dict:
    """Check a mapping against its declarations: an unknown key is an error naming the
    closest known one, a required key must be there, each value is validated; the result
    holds every declared key, absent ones at their defaults."""
    by_name = {option.name: option for option in options}
    for key in section:
        if key not in by_name:
            raise unknown(path, key, by_name, what)
    prefix = f"{path}." if path else ""
    values = {}
    for option in by_name.values():
        where = prefix + option.name
        if option.name in section:
            values[option.name] = option.validate(section[option.name], where)
        elif option.required:
            raise ConfigError(f"{where}: required")
        else:
            values[option.name] = option.initial(where)
    return values


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
        base[name] = check_section(section, options, f"plugins.{name}")
    quirks: dict[str, list[tuple[str, Option]]] = {}
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
                    raise unknown(f"backends[{i}].quirks", key, quirks, "quirk")
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


def markdown_table(options: Iterable[Option], quirks: bool = True) -> str:
    """The docs' table of options, made from their declarations (``quirks``: with the column
    that says whether a backend's ``quirks:`` may set each)."""
    head, rule = "| key | default | values |", "|---|---|---|"
    if quirks:
        head, rule = head + " quirk |", rule + "---|"
    rows = [head + " meaning |", rule + "---|"]
    for option in options:
        kinds = option.kind if isinstance(option.kind, tuple) else (option.kind,)
        values = (" / ".join(f"`{choice}`" for choice in option.choices) if option.choices
                  else " or ".join(_WORDS.get(kind, kind.__name__) for kind in kinds))
        default = ("(required)" if option.required else "—" if option.default is None
                   else f"`{_yaml(option.default)}`")
        quirk = f" {'yes' if option.quirk else 'no'} |" if quirks else ""
        rows.append(f"| `{option.name}` | {default} | {values} |{quirk} {option.help} |")
    return "\n".join(rows)


def _yaml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return '""'
    if value == {}:
        return "{}"
    if isinstance(value, list):
        return "[" + ", ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in value) + "]"
    return str(value)
