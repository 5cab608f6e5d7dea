"""The relay's built-in plugins."""
