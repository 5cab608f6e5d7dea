"""relay: a Messages API relay that repairs tool-use faults on the way through."""

__version__ = "0.1.0"
