"""The relay's built-in plugins, installed as ``relay_builtins`` (see setup.cfg)."""
