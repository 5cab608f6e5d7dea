"""Wire formats other than Anthropic's, translated at the upstream edge.

The plugin chain only ever sees Anthropic requests and Anthropic stream events; a backend's
``format`` says which adapter here stands between the chain and the wire.
"""

FORMATS = ("anthropic", "openai")
# Formats whose requests can carry a server-held thread (``thread``, relay.threads): the
# Chat Completions format has no such field.
THREAD_FORMATS = ("anthropic",)
