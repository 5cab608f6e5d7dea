"""model_blocklist: refuse requests for models the operator has blocked, in the API's own
error format (403 permission_error), before any upstream sees them.

relay.yaml::

    plugins:
      model_blocklist: {blocked: ["claude-opus-*"]}
"""

import fnmatch

from relay.errors import RelayError
from relay.hookspecs import hookimpl
from relay.options import Option

OPTIONS = (
    Option("blocked", list, [], "model name patterns to refuse", quirk=True),
)


@hookimpl
def relay_request(exchange, options):
    if any(fnmatch.fnmatchcase(exchange.model, pattern) for pattern in options["blocked"]):
        raise RelayError(403, f"model {exchange.model} is blocked on this relay",
                         "permission_error")
