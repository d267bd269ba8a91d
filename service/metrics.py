"""Prometheus metrics: requests and latency per route, jobs by state, and whether the store answers.

/metrics never fails with the store: job counts are read from it, and when that read fails the gauge
``multicomposite_store_up`` is 0 (the job gauges keep their last values) rather than the scrape getting a 503, so
that the outage itself is what the metrics show."""

from __future__ import annotations

from fastapi import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from registry.store.job_store import JOB_STATES
from service.jobs.backend import JobBackend


class Metrics:
    def __init__(self, runner: JobBackend | None = None) -> None:
        self.registry = CollectorRegistry()  # one per app: tests create many apps
        self.requests = Counter("multicomposite_requests_total", "HTTP requests", ["route", "method", "status"],
                                registry=self.registry)
        self.latency = Histogram("multicomposite_request_seconds", "HTTP request latency", ["route"],
                                 registry=self.registry)
        self.jobs = Gauge("multicomposite_jobs", "jobs by state (the last values read while the store is down)",
                          ["state"], registry=self.registry)
        self.store_up = Gauge("multicomposite_store_up", "1 when the last read of the store for these metrics "
                              "answered, 0 when it failed", registry=self.registry)
        self.runner = runner  # set when the app's lifespan starts the job worker

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route=route, method=method, status=str(status)).inc()
        self.latency.labels(route=route).observe(seconds)

    def endpoint(self) -> Response:
        try:
            states = self.runner.states() if self.runner is not None else {}
        except Exception:  # any failure of the store (driver errors included): reported, not raised
            self.store_up.set(0)
        else:
            self.store_up.set(1)
            for state in JOB_STATES:
                self.jobs.labels(state=state).set(states.get(state, 0))
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
