"""The relay's built-in plugins."""

# "plugins" is a common name for a top-level package: the host checks for this marker so that
# another installed package of the same name is reported, never silently loaded instead.
RELAY_BUILTINS = True
