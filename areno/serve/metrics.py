"""``/metrics``: the server's counters in the Prometheus text format (0.0.4), through ``prometheus-client``.

The names are vLLM's (``vllm:`` prefix), so dashboards and autoscalers written for vLLM read areno unchanged:

- ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` (gauges): requests (one per prompt) with a first
  token and not finished / submitted to the engine with no token yet (queued or in prefill);
- ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, ``vllm:request_success_total{finished_reason}``
  (counters): prompt tokens submitted, tokens generated, samples finished by reason;
- ``vllm:time_to_first_token_seconds``, ``vllm:time_per_output_token_seconds`` (per sample of two or more tokens:
  (last - first token time) / (tokens - 1)), ``vllm:e2e_request_latency_seconds`` (histograms);
- per engine (label ``engine``: the replica's rank, 0 without replicas), read from its ``BlockManager`` at scrape
  time: ``vllm:kv_cache_usage_perc`` (fraction of the paged KV cache's blocks in use, 0..1) and the counters
  ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (prompt tokens looked up in the prefix
  cache / served from it: hit rate = hits / queries);
- with ``--speculative-tokens``, per engine, the counters ``vllm:spec_decode_num_drafts`` (drafts verified: one per
  speculating sequence and step), ``vllm:spec_decode_num_draft_tokens`` (their tokens) and
  ``vllm:spec_decode_num_accepted_tokens`` (those the target accepted: mean acceptance length = 1 + accepted /
  drafts), and areno's own ``areno:spec_decode_gated_steps`` (counter: steps the gate ran plain) and
  ``areno:spec_decode_limit`` (gauge: the gate's N now, the largest batch that speculates; absent without a gate).

Every series carries ``model_name``; no ``*_created`` series are written. Each app has its own
``CollectorRegistry``, so several servers in one process never clash. Every engine stream the app reads goes
through :class:`MeteredStream`, which updates the request metrics as its events are read (all on the event loop,
so no lock; tokens generated are a plain integer, read at scrape time).
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# no ``*_created`` series beside each counter and histogram (prometheus-client's default, a process-wide switch):
# start timestamps that no dashboard reads, doubling the series
disable_created_metrics()

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
# generate_latest writes the classic text format: version 0.0.4 (what every Prometheus scrapes)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort")  # present (at 0) from the start, as vLLM does
KV_STATS_WAIT_S = 0.5  # how long a scrape waits for the engines' KV-cache counters


def kv_stats(engine) -> dict:
    """An ``Engine``'s KV-cache and prefix-cache counters, and with speculation its totals and gate limit (``spec``),
    run where the engine lives: its thread or replica."""
    b = engine.blocks
    out = {"num_blocks": b.num_blocks, "used_blocks": b.num_used, "prefix_queries": b.prefix_queries,
           "prefix_hits": b.prefix_hits}
    spec = getattr(engine, "spec", None)
    if spec is not None:
        out["spec"] = {**spec.lifetime(), "limit": spec.limit}
    return out


async def engine_kv_stats(engine) -> dict[int, dict]:
    """``kv_stats`` of every engine behind the app's front end, by engine rank: each live replica's through
    ``run_on_every_engine``, else the in-process engine's (plain integers, read from the event loop)."""
    every = getattr(engine, "run_on_every_engine", None)
    if every is not None:
        return {rank: s for rank, s in (await every(kv_stats)).items() if isinstance(s, dict)}
    inner = getattr(engine, "engine", None)
    if inner is None or getattr(inner, "blocks", None) is None:
        return {}
    return {0: kv_stats(inner)}


class _Collector:
    """Series read at scrape time: tokens generated (a plain integer on the per-token path: no lock per token) and
    the per-engine series, from the snapshot the /metrics route took just before writing."""

    def __init__(self, metrics: ServeMetrics, model_name: str):
        self.metrics, self.model_name = metrics, model_name
        self.snapshot: dict[int, dict] = {}

    def collect(self):
        generated = CounterMetricFamily("vllm:generation_tokens", "Tokens generated.", labels=["model_name"])
        generated.add_metric([self.model_name], self.metrics.generation_tokens)
        labels = ["model_name", "engine"]
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "Fraction of the paged KV cache's blocks in use "
                                  "(0 to 1).", labels=labels)
        queries = CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      labels=labels)
        hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache (hit "
                                   "rate = hits / queries).", labels=labels)
        spec = _spec_families(labels)
        for rank, s in sorted(self.snapshot.items()):
            lb = [self.model_name, str(rank)]
            usage.add_metric(lb, s["used_blocks"] / s["num_blocks"] if s["num_blocks"] else 0.0)
            queries.add_metric(lb, s["prefix_queries"])
            hits.add_metric(lb, s["prefix_hits"])
            if "spec" in s:
                _add_spec(spec, lb, s["spec"])
        spec_series = [f for f in spec.values() if f.samples]
        return [generated, usage, queries, hits, *spec_series] if self.snapshot else [generated]


def _spec_families(labels: list[str]) -> dict:
    return {
        "drafts": CounterMetricFamily("vllm:spec_decode_num_drafts", "Speculative drafts verified (one per "
                                      "speculating sequence and step).", labels=labels),
        "draft_tokens": CounterMetricFamily("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.",
                                            labels=labels),
        "accepted": CounterMetricFamily("vllm:spec_decode_num_accepted_tokens", "Draft tokens the target model "
                                        "accepted (mean acceptance length = 1 + accepted / drafts).", labels=labels),
        "gated": CounterMetricFamily("areno:spec_decode_gated_steps", "Steps the speculative gate ran plain (more "
                                     "sequences decoding than its limit).", labels=labels),
        "limit": GaugeMetricFamily("areno:spec_decode_limit", "The speculative gate's limit now: the largest batch "
                                   "that speculates.", labels=labels),
    }


def _add_spec(families: dict, lb: list[str], counts: dict) -> None:
    """One engine's speculation counts (``SpecDecoder.lifetime`` and the gate's ``limit``) into ``families``."""
    families["drafts"].add_metric(lb, counts["verify_rows"])
    families["draft_tokens"].add_metric(lb, counts["proposed"])
    families["accepted"].add_metric(lb, counts["accepted"])
    families["gated"].add_metric(lb, counts["spec_gated_steps"])
    if counts["limit"] is not None:
        families["limit"].add_metric(lb, counts["limit"])


class ServeMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self.waiting: set = set()  # streams submitted, no token yet
        self.running: set = set()  # streams with tokens, not finished
        lb, reg = {"model_name": model_name}, self.registry
        Gauge("vllm:num_requests_running", "Requests (one per prompt) generating: first token sent, not finished.",
              ["model_name"], registry=reg).labels(**lb).set_function(lambda: len(self.running))
        Gauge("vllm:num_requests_waiting", "Requests (one per prompt) submitted to the engine that have no token "
              "yet (queued or in prefill).", ["model_name"], registry=reg).labels(**lb).set_function(
            lambda: len(self.waiting))
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens submitted to the engine.",
                                     ["model_name"], registry=reg).labels(**lb)
        self.generation_tokens = 0
        success = Counter("vllm:request_success", "Samples finished, by finish reason.",
                          ["model_name", "finished_reason"], registry=reg)
        self.finished = {r: success.labels(model_name=model_name, finished_reason=r) for r in FINISH_REASONS}
        self._success, self._model_name = success, model_name
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Seconds from the request's arrival to its first "
                              "generated token.", ["model_name"], buckets=TTFT_BUCKETS, registry=reg).labels(**lb)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Mean seconds between a sample's generated "
                              "tokens after the first (one observation per sample of two or more tokens).",
                              ["model_name"], buckets=TPOT_BUCKETS, registry=reg).labels(**lb)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Seconds from a request's arrival to the end of "
                             "its last sample.", ["model_name"], buckets=E2E_BUCKETS, registry=reg).labels(**lb)
        self.scraped = _Collector(self, model_name)
        reg.register(self.scraped)

    def finish(self, reason: str) -> None:
        child = self.finished.get(reason)
        if child is None:
            child = self.finished[reason] = self._success.labels(model_name=self._model_name, finished_reason=reason)
        child.inc()

    def track(self, stream, prompt_tokens: int, arrival: float) -> MeteredStream:
        self.prompt_tokens.inc(prompt_tokens)
        return MeteredStream(stream, self, arrival)

    async def render(self, engine) -> bytes:
        """The exposition text, with ``engine``'s KV-cache and prefix-cache counters read now: an engine busy in a
        long step for more than ``KV_STATS_WAIT_S`` leaves the last values it gave (a scrape never waits on it)."""
        try:
            self.scraped.snapshot = await asyncio.wait_for(engine_kv_stats(engine), KV_STATS_WAIT_S)
        except asyncio.TimeoutError:
            pass
        return generate_latest(self.registry)


class MeteredStream:
    """An engine stream (``RequestStream``) as the app reads it, counting its events into ``ServeMetrics``; it
    leaves the running/waiting gauges when its samples have all finished, it fails, or it is aborted."""

    def __init__(self, inner, metrics: ServeMetrics, arrival: float):
        self._inner, self._m, self._arrival = inner, metrics, arrival
        self._samples: dict[int, list] = {}  # index -> [first token time, last token time, tokens]
        self._finished = 0
        self._done = False
        self._aborted = False  # its unfinished samples were counted as "abort" when it was aborted
        metrics.waiting.add(self)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _end(self) -> None:
        if not self._done:
            self._done = True
            self._m.waiting.discard(self)
            self._m.running.discard(self)

    def _see(self, ev) -> None:
        now, m = time.perf_counter(), self._m
        if ev.token_id is not None:
            m.generation_tokens += 1
            s = self._samples.get(ev.index)
            if s is None:
                s = self._samples[ev.index] = [now, now, 0]
                if len(self._samples) == 1:
                    m.ttft.observe(now - self._arrival)
                    if not self._done:
                        m.waiting.discard(self)
                        m.running.add(self)
            s[1] = now
            s[2] += 1
        if ev.finish_reason is not None:
            if not self._aborted:
                m.finish(ev.finish_reason)
            s = self._samples.get(ev.index)
            if s is not None and s[2] > 1:
                m.tpot.observe((s[1] - s[0]) / (s[2] - 1))
            self._finished += 1
            if self._finished >= self._inner.options.n:
                m.e2e.observe(now - self._arrival)
                self._end()

    def pending(self):
        events = self._inner.pending()
        for ev in events:
            self._see(ev)
        return events

    def abort(self) -> None:
        """Abort the request; samples not finished yet count as ``finished_reason="abort"`` (a client gone, a
        failure), once."""
        self._inner.abort()
        if not self._aborted and self._finished < self._inner.options.n:  # (a cancelled read has ended it)
            self._aborted = True
            for _ in range(self._inner.options.n - self._finished):
                self._m.finish("abort")
        self._end()

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            ev = await self._inner.__anext__()
        except StopAsyncIteration:
            self._end()
            raise
        except BaseException:
            self._end()
            raise
        self._see(ev)
        return ev
