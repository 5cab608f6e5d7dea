"""event_counter: count the events of each stream and say so in the exchange's timeline (and
so in any dump), by event name."""

from collections import Counter

from relay.hookspecs import hookimpl

PLUGIN = "event_counter"


class EventCounter:
    @hookimpl
    def relay_stream_events(self, exchange):
        exchange.state[PLUGIN] = Counter()
        return "*"

    @hookimpl
    def relay_stream_event(self, exchange, event):
        exchange.state[PLUGIN][event.name] += 1

    @hookimpl
    def relay_exchange_end(self, exchange):
        counts = exchange.state.get(PLUGIN)
        if counts:
            exchange.note(PLUGIN, "counted", events=dict(counts), total=sum(counts.values()))
