"""team_header: tell the upstream which team a request comes from, in a header of its own.

relay.yaml::

    pipeline: [team_header, ...]
    plugins:
      team_header: {team: research}
"""

from relay.hookspecs import hookimpl
from relay.options import Option


class TeamHeader:
    OPTIONS = (
        Option("team", str, None, "the team name to send (required)"),
        Option("header", str, "x-team", "the header it goes in", quirk=True),
    )

    @hookimpl
    def relay_startup(self, options):
        from relay.errors import ConfigError
        if not options["team"]:
            raise ConfigError("plugins.team_header.team: required")

    @hookimpl
    def relay_request(self, exchange, options):
        exchange.upstream_headers[options["header"]] = options["team"]
