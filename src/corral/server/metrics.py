"""Prometheus metrics of one server (its own registry: two servers in a process never mix)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CREATE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.live = Gauge("corral_live_sandboxes", "Sandboxes alive in this server", registry=r)
        self.create_seconds = Histogram("corral_sandbox_create_seconds", "Time to create a sandbox (cold)",
                                        buckets=CREATE_BUCKETS, registry=r)
        self.pool_idle = Gauge("corral_pool_idle_sandboxes", "Fresh sandboxes waiting in warm pools", registry=r)
        self.pool_hits = Counter("corral_pool_hits", "Creates served from a warm pool", registry=r)
        self.execs = Counter("corral_execs", "Commands run", registry=r)
        self.timeouts = Counter("corral_exec_timeouts", "Commands killed by their timeout", registry=r)
        self.oom_kills = Counter("corral_oom_kills", "Commands killed by the memory limit", registry=r)
        #: fed by the egress layer's refusal reports when a sandbox exposes them (see docs/server.md)
        self.egress_refused = Counter("corral_egress_refused", "Connections refused by egress policy", registry=r)
        self.expired = Counter("corral_sandboxes_expired", "Sandboxes destroyed by idle timeout or lifetime",
                               registry=r)
        self.quota_refusals = Counter("corral_quota_refusals", "Requests refused with 429", registry=r)

    def record_exec(self, timed_out: bool, oom_killed: bool) -> None:
        self.execs.inc()
        if timed_out:
            self.timeouts.inc()
        if oom_killed:
            self.oom_kills.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
