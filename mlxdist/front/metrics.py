"""The front's ``/metrics``, in Prometheus' text format (prometheus_client):
what it answered and the job's state, read at each scrape.

    mlxdist_requests_total{path, status}        requests answered
    mlxdist_prompt_tokens_total, mlxdist_completion_tokens_total
                                                tokens, from the answers' usage
    mlxdist_time_to_first_token_seconds         a stream's first token (histogram)
    mlxdist_time_per_output_token_seconds       between two chunks of a stream: a decode step as the
                                                client sees it (histogram)
    mlxdist_request_seconds                     a request's whole answer (histogram)
    mlxdist_requests_queued                     forwarded, no byte of the answer yet
    mlxdist_requests_running                    forwarded, not finished
    mlxdist_requests_held                       lost by the job before any answer, waiting for the next
    mlxdist_requests_replayed_total             such requests sent again to the next job
    mlxdist_ranks_alive                         ranks of the job while it serves, else 0
    mlxdist_recoveries_total                    restarts of the job on the survivors
    mlxdist_serving                             1 while the job serves
    mlxdist_rank0_exchange_bytes_total{direction}
                                                rank 0's dispatchers' bytes handed to the exchange
                                                (sent) and got back (received), as the arrays' sizes,
                                                since the job started (its /health)
    mlxdist_step_seconds                        rank 0's batch steps (a prefill chunk, or a decode
                                                token for every sequence), since the job started
                                                (histogram; serving/step_times.py)
    mlxdist_link_bytes_total{rank, host, interface, direction}
                                                bytes through the interface each rank reaches rank 0
                                                by, as its OS counts them (all its traffic: on one
                                                host, loopback's), since the job started; with the
                                                heartbeat on (runtime/link_bytes.py)
"""

from typing import Any, Dict, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SERVING_STATES = ("ok", "degraded")
_STEP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class FrontMetrics:
    """One front's metrics, in a registry of its own; ``job`` has
    ``state``, ``ranks`` and may have ``recoveries``; ``upstream`` (where
    given) has ``held`` and ``replayed``."""

    def __init__(self, job: Any, upstream: Any = None):
        self.registry = CollectorRegistry()
        self.requests = Counter("mlxdist_requests", "Requests answered, by path and HTTP status.",
                                ["path", "status"], registry=self.registry)
        self.prompt_tokens = Counter("mlxdist_prompt_tokens", "Prompt tokens of answered requests (their usage).",
                                     registry=self.registry)
        self.completion_tokens = Counter("mlxdist_completion_tokens",
                                         "Tokens generated for answered requests (their usage).",
                                         registry=self.registry)
        self.first_token = Histogram("mlxdist_time_to_first_token_seconds",
                                     "Seconds from a stream's request to its first token.",
                                     buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.per_token = Histogram("mlxdist_time_per_output_token_seconds",
                                   "Seconds between two chunks of a stream (a decode step, as the client sees it).",
                                   buckets=_STEP_BUCKETS, registry=self.registry)
        self.latency = Histogram("mlxdist_request_seconds", "Seconds from a request to the end of its answer.",
                                 buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.queued = Gauge("mlxdist_requests_queued", "Requests forwarded to the job with no byte of answer yet.",
                            registry=self.registry)
        self.running = Gauge("mlxdist_requests_running", "Requests forwarded to the job and not finished.",
                             registry=self.registry)
        self.rank_health: Optional[Dict[str, Any]] = None  # the rank server's /health, read before each scrape
        self.registry.register(_JobCollector(job, upstream, self))

    def count_usage(self, usage: Optional[Dict[str, Any]]) -> None:
        """Add an answer's ``usage`` (prompt and completion tokens) where it has one."""
        if not isinstance(usage, dict):
            return
        for key, counter in (("prompt_tokens", self.prompt_tokens), ("completion_tokens", self.completion_tokens)):
            value = usage.get(key)
            if type(value) is int and value >= 0:
                counter.inc(value)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _JobCollector:
    """The job's state, and the requests held for the next job, at scrape time."""

    def __init__(self, job: Any, upstream: Any = None, metrics: Optional[FrontMetrics] = None):
        self.job, self.upstream, self.metrics = job, upstream, metrics

    def collect(self):
        serving = getattr(self.job, "state", "stopped") in SERVING_STATES
        alive = GaugeMetricFamily("mlxdist_ranks_alive", "Ranks of the job while it serves (0 while it does not).")
        alive.add_metric([], float(getattr(self.job, "ranks", 0) or 0) if serving else 0.0)
        yield alive
        up = GaugeMetricFamily("mlxdist_serving", "1 while the rank job serves, else 0.")
        up.add_metric([], 1.0 if serving else 0.0)
        yield up
        recoveries = CounterMetricFamily("mlxdist_recoveries", "Restarts of the job on the ranks left after a loss.")
        recoveries.add_metric([], float(getattr(self.job, "recoveries", 0) or 0))
        yield recoveries
        if self.upstream is not None:
            held = GaugeMetricFamily("mlxdist_requests_held",
                                     "Requests the job lost before answering anything, waiting for the next job.")
            held.add_metric([], float(self.upstream.held))
            yield held
            replayed = CounterMetricFamily("mlxdist_requests_replayed",
                                           "Requests lost before answering anything and sent again to the next job.")
            replayed.add_metric([], float(self.upstream.replayed))
            yield replayed
        health = self.metrics.rank_health if self.metrics is not None else None
        yield from _rank_families(health if isinstance(health, dict) else {})

    def describe(self):
        return []


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**63


def _rank_families(health: Dict[str, Any]):
    """The rank server's counters (its /health: ``serving/http.py``), each
    where it is well formed: rank 0's exchange bytes, the step histogram,
    the ranks' link bytes."""
    counted = health.get("exchange_bytes")
    if isinstance(counted, dict) and all(_count(counted.get(k)) for k in ("sent", "received")):
        exchange = CounterMetricFamily("mlxdist_rank0_exchange_bytes",
                                       "Bytes rank 0's dispatchers handed to the exchange (sent) and got back "
                                       "(received), as the arrays' sizes, since the job started.",
                                       labels=["direction"])
        for direction in ("sent", "received"):
            exchange.add_metric([direction], float(counted[direction]))
        yield exchange
    steps = health.get("step_seconds")
    if isinstance(steps, dict):
        bounds, counts, total, count = (steps.get(k) for k in ("buckets", "counts", "sum", "count"))
        if isinstance(bounds, list) and isinstance(counts, list) and len(bounds) == len(counts) \
                and all(isinstance(b, (int, float)) for b in bounds) and all(_count(c) for c in counts) \
                and _count(count) and isinstance(total, (int, float)):
            histogram = HistogramMetricFamily("mlxdist_step_seconds",
                                              "Seconds of rank 0's batch steps (a prefill chunk, or one token "
                                              "for every sequence), since the job started.")
            histogram.add_metric([], [(repr(float(b)), float(c)) for b, c in zip(bounds, counts)]
                                 + [("+Inf", float(count))], float(total))
            yield histogram
    links = health.get("link_bytes")
    if isinstance(links, list):
        family = CounterMetricFamily("mlxdist_link_bytes",
                                     "Bytes through the interface each rank reaches rank 0 by, as its OS counts "
                                     "them (all that interface carries), since the job started.",
                                     labels=["rank", "host", "interface", "direction"])
        for row in links[:1024]:
            if not (isinstance(row, dict) and _count(row.get("rank")) and isinstance(row.get("host"), str)
                    and isinstance(row.get("interface"), str)):
                continue
            for direction in ("sent", "received"):
                if _count(row.get(direction)):
                    family.add_metric([str(row["rank"]), row["host"][:256], row["interface"][:64], direction],
                                      float(row[direction]))
        yield family
