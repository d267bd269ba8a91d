"""Prometheus metrics: requests and latency per route, jobs by state."""

from __future__ import annotations

from fastapi import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from service.jobs import JobRunner


class Metrics:
    def __init__(self, runner: JobRunner) -> None:
        self.registry = CollectorRegistry()  # one per app: tests create many apps
        self.requests = Counter("multicomposite_requests_total", "HTTP requests", ["route", "method", "status"],
                                registry=self.registry)
        self.latency = Histogram("multicomposite_request_seconds", "HTTP request latency", ["route"],
                                 registry=self.registry)
        self.jobs = Gauge("multicomposite_jobs", "jobs by state", ["state"], registry=self.registry)
        self._runner = runner

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route=route, method=method, status=str(status)).inc()
        self.latency.labels(route=route).observe(seconds)

    def endpoint(self) -> Response:
        states = self._runner.states()
        for state in ("queued", "running", "done", "failed", "cancelled"):
            self.jobs.labels(state=state).set(states.get(state, 0))
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
