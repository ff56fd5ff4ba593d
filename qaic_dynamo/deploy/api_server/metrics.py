"""The server's Prometheus metrics, named as vLLM names them (prefix ``qaic:``).

Each app has a registry of its own, so two servers in one process (tests) do not share
counts. Queue lengths are read from the scheduler when ``/metrics`` is scraped.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["ServerMetrics"]

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)


class ServerMetrics:
    """Requests, tokens, TTFT, time per output token and queue lengths."""

    def __init__(self, model_name: str, engine: Any) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name
        self.requests = Counter(
            "qaic:request_success",
            "Finished requests, by finish reason",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.failed = Counter("qaic:request_failure", "Requests a failed step lost", labels, registry=self.registry)
        self.prompt_tokens = Counter(
            "qaic:prompt_tokens", "Prompt tokens of finished requests", labels, registry=self.registry
        )
        self.generation_tokens = Counter("qaic:generation_tokens", "Generated tokens", labels, registry=self.registry)
        self.ttft = Histogram(
            "qaic:time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "qaic:time_per_output_token_seconds",
            "Seconds between a request's consecutive output tokens",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        )
        self.running = Gauge(
            "qaic:num_requests_running", "Requests running in the engine", labels, registry=self.registry
        )
        self.waiting = Gauge(
            "qaic:num_requests_waiting", "Requests waiting for the engine", labels, registry=self.registry
        )
        self.running.labels(model_name).set_function(lambda: engine.num_running)
        self.waiting.labels(model_name).set_function(lambda: engine.num_waiting)

    def on_token(self, n: int) -> None:
        self.generation_tokens.labels(self.model_name).inc(n)

    def on_finish(self, stream: Any, failed: str | None) -> None:
        """A request finished (on the engine thread)."""
        if failed is not None:
            self.failed.labels(self.model_name).inc()
            return
        self.prompt_tokens.labels(self.model_name).inc(stream.prompt_tokens)
        if stream.first_token is not None:
            self.ttft.labels(self.model_name).observe(stream.first_token - stream.submitted)
        for gap in stream.gaps:
            self.tpot.labels(self.model_name).observe(gap)

    def finished(self, reason: str | None) -> None:
        self.requests.labels(self.model_name, reason or "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
