"""The front door's Prometheus metrics: requests by route, model and status, the requests
handed to another replica, and how often a replica became suspect here.

Every label comes from a fixed set, never from what a client sent: the route is the
template that matched (`unmatched` for any other path), the model one of the models the
fleet serves (`other` for any other name, or none), so a scan of paths or of model names
adds no series. Replica ids are left out on purpose: each placement makes new ones, so a
label by replica would grow with the fleet's history.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # supervisor.front_door imports this module
    from supervisor.front_door import Route

OTHER = "other"
UNMATCHED = "unmatched"


def route_label(request: web.Request) -> str:
    """The route's template, never the raw path."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else UNMATCHED


def model_label(model: object, route: Route) -> str:
    """`model` when the fleet serves it (its route is no 400 or 404), else `other`."""
    return model if isinstance(model, str) and route.status not in (400, 404) else OTHER


class _Suspected(Collector):
    """A counter kept by supervisor.relays (`Relays.suspected_total`), read when scraped."""

    def __init__(self, total: Callable[[], int]) -> None:
        self.total = total

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("ringfleet_front_door_suspected",
                                  "Times a replica's rank 0 did not answer here and was "
                                  "routed nothing new until it did", value=self.total())


class FrontDoorMetrics:
    def __init__(self, suspected_total: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ringfleet_front_door_requests",
                                "Front door requests by route, model and status",
                                ["endpoint", "model", "status"], registry=r)
        self.handed_on = Counter("ringfleet_front_door_handed_on",
                                 "Requests a replica did not take, handed to the next",
                                 ["model"], registry=r)
        r.register(_Suspected(suspected_total))

    def render(self) -> bytes:
        return generate_latest(self.registry)
