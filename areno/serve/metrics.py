"""``/metrics``: the server's counters in the Prometheus text exposition format (version 0.0.4), written here
(``prometheus-client`` is not a dependency).

Requests running and waiting, prompt and generation tokens, finished samples by reason, and histograms of the time
to first token and the time per output token. Every engine stream the app reads goes through
:class:`MeteredStream`, which updates them as its events are read (all on the event loop, so no lock)."""

from __future__ import annotations

import math
import time

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


class Histogram:
    def __init__(self, buckets):
        self.bounds = tuple(buckets)
        self.counts = [0] * len(self.bounds)  # per bucket, made cumulative when written
        self.count, self.sum = 0, 0.0

    def observe(self, v: float) -> None:
        self.count += 1
        self.sum += v
        for i, b in enumerate(self.bounds):
            if v <= b:
                self.counts[i] += 1
                break

    def lines(self, name: str, labels: dict) -> list[str]:
        out, running = [], 0
        for b, c in zip(self.bounds, self.counts):
            running += c
            out.append(f"{name}_bucket{_labels({**labels, 'le': _num(b)})} {running}")
        out.append(f"{name}_bucket{_labels({**labels, 'le': '+Inf'})} {self.count}")
        out.append(f"{name}_sum{_labels(labels)} {_num(self.sum)}")
        out.append(f"{name}_count{_labels(labels)} {self.count}")
        return out


class ServeMetrics:
    def __init__(self, model_name: str):
        self.labels = {"model_name": model_name}
        self.waiting: set = set()  # streams submitted, no token yet
        self.running: set = set()  # streams with tokens, not finished
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}  # finish reason -> samples
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def track(self, stream, prompt_tokens: int, arrival: float) -> MeteredStream:
        self.prompt_tokens += prompt_tokens
        return MeteredStream(stream, self, arrival)

    def render(self, gauges: dict[str, tuple[str, float]] | None = None) -> str:
        """The exposition text; ``gauges`` adds ``name -> (help, value)`` read from the engine."""
        lb = self.labels
        out = []

        def head(name, kind, help_):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")

        head("areno_num_requests_running", "gauge", "Requests (one per prompt) generating: first token sent, not "
             "finished.")
        out.append(f"areno_num_requests_running{_labels(lb)} {len(self.running)}")
        head("areno_num_requests_waiting", "gauge", "Requests (one per prompt) submitted to the engine that have "
             "no token yet (queued or in prefill).")
        out.append(f"areno_num_requests_waiting{_labels(lb)} {len(self.waiting)}")
        for name, (help_, value) in (gauges or {}).items():
            head(name, "gauge", help_)
            out.append(f"{name}{_labels(lb)} {_num(value)}")
        head("areno_prompt_tokens_total", "counter", "Prompt tokens submitted to the engine.")
        out.append(f"areno_prompt_tokens_total{_labels(lb)} {self.prompt_tokens}")
        head("areno_generation_tokens_total", "counter", "Tokens generated.")
        out.append(f"areno_generation_tokens_total{_labels(lb)} {self.generation_tokens}")
        head("areno_request_success_total", "counter", "Samples finished, by finish reason.")
        for reason in sorted(self.finished) or ["stop"]:
            out.append(f"areno_request_success_total{_labels({**lb, 'finished_reason': reason})} "
                       f"{self.finished.get(reason, 0)}")
        head("areno_time_to_first_token_seconds", "histogram", "Seconds from the request's arrival to its first "
             "generated token.")
        out += self.ttft.lines("areno_time_to_first_token_seconds", lb)
        head("areno_time_per_output_token_seconds", "histogram", "Mean seconds between a sample's generated "
             "tokens after the first (one observation per sample of two or more tokens).")
        out += self.tpot.lines("areno_time_per_output_token_seconds", lb)
        head("areno_e2e_request_latency_seconds", "histogram", "Seconds from a request's arrival to the end of "
             "its last sample.")
        out += self.e2e.lines("areno_e2e_request_latency_seconds", lb)
        return "\n".join(out) + "\n"


class MeteredStream:
    """An engine stream (``RequestStream``) as the app reads it, counting its events into ``ServeMetrics``; it
    leaves the running/waiting gauges when its samples have all finished, it fails, or it is aborted."""

    def __init__(self, inner, metrics: ServeMetrics, arrival: float):
        self._inner, self._m, self._arrival = inner, metrics, arrival
        self._samples: dict[int, list] = {}  # index -> [first token time, last token time, tokens]
        self._finished = 0
        self._done = False
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
            m.finished[ev.finish_reason] = m.finished.get(ev.finish_reason, 0) + 1
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
        self._inner.abort()
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
