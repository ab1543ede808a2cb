"""The router's Prometheus series (docs/router.md, Metrics), on its own registry."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PICK_REASONS = ("prefix", "load", "affinity", "round_robin")


class RouterMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.picks = Counter("shoal_router_picks", "Requests sent to a first backend, by why it won", ["reason"], registry=r)
        for reason in PICK_REASONS:
            self.picks.labels(reason)
        self.retries = Counter("shoal_router_retries", "Requests moved to the next backend (connect error or 503 before the first byte)", registry=r)
        self.pending = Gauge("shoal_router_pending_requests", "Requests held while no backend is ready", registry=r)
        self.rejected = Counter("shoal_router_rejected", "Requests the router refused with 503", ["reason"], registry=r)
        for reason in ("pending_full", "no_backend"):
            self.rejected.labels(reason)
        self.score = Gauge("shoal_router_backend_score", "The backend's score in the latest pick", ["backend"], registry=r)
        self.blocks = Gauge("shoal_router_backend_blocks", "Prefix-cache blocks the backend holds (its latest poll)", ["backend"], registry=r)
        self.ready = Gauge("shoal_router_backend_ready", "1 when the backend's latest poll said ready", ["backend"], registry=r)
        self.overhead = Histogram("shoal_router_overhead_seconds", "The router's own time before a request goes out: body, tokenize, hash, pick",
                                  buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0), registry=r)
        self.abandoned = Counter("shoal_router_abandoned", "Requests whose client left before the first byte (held: never sent; in flight: aborted at the group)",
                                 registry=r)
        self.unhashed = Counter("shoal_router_unhashed", "Requests routed without hashes: unreadable (the group answers its 400), too_long (refused by size, not tokenized)",
                                ["reason"], registry=r)
        for reason in ("unreadable", "too_long"):
            self.unhashed.labels(reason)
        self.load = Gauge("shoal_router_backend_load", "The picker's load term of the backend, 0 to 1", ["backend"], registry=r)

    def backend_polled(self, b, load: float) -> None:
        self.blocks.labels(b.name).set(len(b.blocks))
        self.ready.labels(b.name).set(1.0 if b.ready else 0.0)
        self.load.labels(b.name).set(load)

    def forget(self, name: str) -> None:
        for g in (self.score, self.blocks, self.ready, self.load):
            try:
                g.remove(name)
            except KeyError:
                pass

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
