"""Example relay plugins: see the README beside this package."""
