"""Prometheus metrics of one server: request outcomes and latencies, and the scheduler's own counters."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


class _SchedulerCollector:
    """Read at scrape time from Scheduler.stats(): never out of date, nothing to update per round."""

    def __init__(self, stats):
        self.stats = stats

    def collect(self):
        s = self.stats()
        yield GaugeMetricFamily("trtspec_running_requests", "Requests in engine rows", value=s.running)
        yield GaugeMetricFamily("trtspec_queue_depth", "Requests waiting for an engine row", value=s.waiting)
        yield GaugeMetricFamily("trtspec_prefix_cache_bytes", "KV bytes held by the prefix cache", value=s.prefix_cache_bytes)
        yield GaugeMetricFamily("trtspec_draft_acceptance_rate", "Accepted / proposed draft tokens since start",
                                value=s.accepted / s.proposed if s.proposed else 0.0)
        for name, doc, value in (
            ("trtspec_rounds", "Scheduler rounds (verify calls)", s.rounds),
            ("trtspec_draft_tokens_proposed", "Draft tokens proposed", s.proposed),
            ("trtspec_draft_tokens_accepted", "Draft tokens accepted", s.accepted),
            ("trtspec_prefix_cache_hits", "Admissions that reused cached prefix slots", s.prefix_hits),
            ("trtspec_prefix_cache_misses", "Admissions that found no cached prefix", s.prefix_misses),
            ("trtspec_prefix_tokens_reused", "Prompt tokens not recomputed thanks to the prefix cache",
             s.prefix_tokens_reused),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        k = GaugeMetricFamily("trtspec_rounds_by_k", "Rounds that chose k draft tokens", labels=["k"])
        for kk, n in sorted(s.k_histogram.items()):
            k.add_metric([str(kk)], n)
        yield k
        tree = GaugeMetricFamily("trtspec_rounds_by_tree_shape", "Rounds that verified a token tree, by its shape",
                                 labels=["shape"])
        for shape, n in sorted(s.tree_shapes.items()):
            tree.add_metric([str(shape)], n)
        yield tree
        by = GaugeMetricFamily("trtspec_draft_acceptance_rate_by_drafter",
                               "Accepted / proposed draft tokens since start, by the drafter that proposed them",
                               labels=["drafter"])
        proposed = CounterMetricFamily("trtspec_draft_tokens_proposed_by_drafter", "Draft tokens proposed, by drafter",
                                       labels=["drafter"])
        accepted = CounterMetricFamily("trtspec_draft_tokens_accepted_by_drafter", "Draft tokens accepted, by drafter",
                                       labels=["drafter"])
        for name, (p, a) in sorted(s.by_drafter.items()):
            by.add_metric([name], a / p if p else 0.0)
            proposed.add_metric([name], p)
            accepted.add_metric([name], a)
        yield by
        yield proposed
        yield accepted


class Metrics:
    """``stats``: a scheduler's ``stats`` method, read at each scrape (None: request metrics only, e.g. a
    Ray Serve ingress whose schedulers live in the engine replicas and export their own)."""

    def __init__(self, stats=None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("trtspec_requests", "Requests by endpoint and HTTP status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("trtspec_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("trtspec_generation_tokens", "Tokens generated for finished requests",
                                        registry=r)
        self.ttft = Histogram("trtspec_time_to_first_token_seconds", "Submission to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("trtspec_inter_token_latency_seconds", "Per token after the first: block gap / block size",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("trtspec_request_latency_seconds", "Submission to last token", buckets=_LATENCY_BUCKETS,
                             registry=r)
        if stats is not None:
            r.register(_SchedulerCollector(stats))

    def request_done(self, endpoint: str, status: int, result=None):
        self.requests.labels(endpoint, str(status)).inc()
        if result is None:
            return
        s = result.stats
        self.prompt_tokens.inc(s.prompt_tokens)
        self.generated_tokens.inc(len(result.token_ids))
        if result.token_ids:
            self.ttft.observe(s.time_to_first_token_s)
        for x in s.inter_token_s:
            self.itl.observe(x)
        self.e2e.observe(s.elapsed_s)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
