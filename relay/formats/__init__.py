"""Wire formats other than Anthropic's, translated at the upstream edge.

The plugin chain only ever sees Anthropic requests and Anthropic stream events; a backend's
``format`` picks the adapter here (:class:`relay.formats.base.Adapter`) that stands between
the chain and the wire, once, when the config loads (``backend.adapter``).
"""

from __future__ import annotations

from .base import ANTHROPIC, Adapter, Translator
from .openai import OPENAI

ADAPTERS: dict[str, Adapter] = {adapter.name: adapter for adapter in (ANTHROPIC, OPENAI)}
FORMATS = tuple(ADAPTERS)

__all__ = ["ADAPTERS", "ANTHROPIC", "FORMATS", "OPENAI", "Adapter", "Translator"]
