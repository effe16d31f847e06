"""A small Prometheus text-format registry, with vLLM's metric names so existing dashboards work."""
from __future__ import annotations

import bisect
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

if TYPE_CHECKING:
    from streamer.core.request import Request
    from streamer.engine.output_processor import TokenTimings

Labels = tuple[tuple[str, str], ...]


def _fmt_labels(labels: Labels, extra: str = "") -> str:
    parts = [f'{k}="{v}"' for k, v in labels] + ([extra] if extra else [])
    return "{" + ",".join(parts) + "}" if parts else ""


class Metric:
    kind = "untyped"

    def __init__(self, name: str, help: str) -> None:
        self.name, self.help = name, help
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(Metric):
    kind = "counter"

    def __init__(self, name: str, help: str) -> None:
        super().__init__(name, help)
        self.values: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> list[str]:
        rows = self.values.items() or [((), 0.0)]
        return self.header() + [f"{self.name}{_fmt_labels(k)} {v}" for k, v in rows]


class Gauge(Metric):
    """A value read at scrape time from a callback returning {labels: value} (a gauge, or a counter that the
    engine keeps itself)."""

    kind = "gauge"

    def __init__(self, name: str, help: str, read: Callable[[], dict[Labels, float]], kind: str = "gauge") -> None:
        super().__init__(name, help)
        self.read = read
        self.kind = kind

    def render(self) -> list[str]:
        rows = self.read().items() or [((), 0.0)]
        return self.header() + [f"{self.name}{_fmt_labels(k)} {v}" for k, v in rows]


def _le(bound: object) -> str:
    return 'le="' + str(bound) + '"'


class Histogram(Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: list[float], labels: Callable[[], Labels] = lambda: ()
                 ) -> None:
        """labels: read at scrape time (the model's served name, which the server may set after start-up)."""
        super().__init__(name, help)
        self.labels = labels
        self.buckets = sorted(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, count: int = 1) -> None:
        """`count` observations of the same value."""
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += count
            self.sum += value * count
            self.count += count

    def render(self) -> list[str]:
        lines = self.header()
        labels = self.labels()
        acc = 0
        for le, c in zip(self.buckets, self.counts):
            acc += c
            lines.append(f"{self.name}_bucket{_fmt_labels(labels, _le(le))} {acc}")
        lines.append(f"{self.name}_bucket{_fmt_labels(labels, _le('+Inf'))} {self.count}")
        lines += [f"{self.name}_sum{_fmt_labels(labels)} {self.sum}",
                  f"{self.name}_count{_fmt_labels(labels)} {self.count}"]
        return lines


_LATENCY = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_LENGTHS = [2.0 ** i for i in range(18)]
_STEP_TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]  # vLLM's buckets
_PARAMS_N = [1, 2, 5, 10, 20]
STALL_FACTOR = 3.0  # an inter-token gap over this many times the median is a stall


class StallCounter:
    """Inter-token gaps over STALL_FACTOR x the median of the recent ones (the last `window`; the median is
    recomputed every `every` gaps, from the first `every` on): the freezes a reader notices."""

    def __init__(self, window: int = 2048, every: int = 64) -> None:
        self._gaps = np.zeros(window)
        self._n = 0  # gaps seen
        self._every = every
        self._median = 0.0
        self.stalls = 0

    def observe(self, seconds: float, count: int = 1) -> int:
        """Record `count` gaps of `seconds`; returns how many of them were stalls."""
        size = len(self._gaps)
        for _ in range(min(count, size)):
            self._gaps[self._n % size] = seconds
            self._n += 1
            if self._n % self._every == 0:
                self._median = float(np.median(self._gaps[:min(self._n, size)]))
        stalled = count if self._median > 0 and seconds > STALL_FACTOR * self._median else 0
        self.stalls += stalled
        return stalled


class Registry:
    def __init__(self) -> None:
        self.metrics: list[Metric] = []

    def add(self, metric: Metric) -> Metric:
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        return "\n".join(line for m in self.metrics for line in m.render()) + "\n"


class EngineMetrics:
    """The engine's metrics. Gauges read live engine state; counters and histograms are fed per request."""

    def __init__(self, stats: Callable[[], dict], model_name: str) -> None:
        self.registry = r = Registry()
        self.model_name = model_name  # the served name; the server may set it after start-up

        def gauge(key: str) -> Callable[[], dict[Labels, float]]:
            return lambda: {(("model_name", self.model_name),): float(stats()[key])}

        def per_priority(key: str) -> Callable[[], dict[Labels, float]]:
            return lambda: {(("model_name", self.model_name), ("priority", str(p))): float(v)
                            for p, v in stats()[key].items()}

        r.add(Gauge("vllm:num_requests_running", "Requests in the running batch.", gauge("num_running")))
        r.add(Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", gauge("num_waiting")))
        r.add(Gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", gauge("kv_cache_usage")))
        r.add(Gauge("streamer:num_requests_running_by_priority", "Running requests per priority.",
                    per_priority("running_by_priority")))
        r.add(Gauge("streamer:num_requests_waiting_by_priority", "Waiting requests per priority.",
                    per_priority("waiting_by_priority")))
        r.add(Gauge("vllm:num_preemptions_total", "Preemptions (by recompute) so far.", gauge("num_preemptions"), kind="counter"))
        r.add(Gauge("vllm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
                    gauge("prefix_cache_queries"), kind="counter"))
        r.add(Gauge("vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
                    gauge("prefix_cache_hits"), kind="counter"))
        r.add(Gauge("streamer:step_time_budget_seconds", "The last step's time budget (stall-free scheduling; 0: "
                    "none, no stream was decoding).", gauge("step_time_budget")))
        r.add(Gauge("streamer:step_time_prediction_error", "The step-time model's relative error (|predicted - "
                    "measured| / measured), smoothed over recent steps.", gauge("step_time_prediction_error")))
        r.add(Gauge("streamer:itl_target_unmet_steps_total", "Steps whose decodes alone were predicted over the "
                    "inter-token latency target (max_itl_ms).", gauge("itl_target_unmet_steps"), kind="counter"))
        r.add(Gauge("vllm:spec_decode_num_draft_tokens_total", "Speculative draft tokens verified.",
                    gauge("spec_num_draft_tokens"), kind="counter"))
        r.add(Gauge("vllm:spec_decode_num_accepted_tokens_total", "Speculative draft tokens accepted.",
                    gauge("spec_num_accepted_tokens"), kind="counter"))

        def lora_info() -> dict[Labels, float]:
            st = stats()
            if "max_lora" not in st:
                return {}
            return {(("max_lora", str(st["max_lora"])),
                     ("running_lora_adapters", ",".join(st["running_lora_adapters"])),
                     ("waiting_lora_adapters", ",".join(st["waiting_lora_adapters"]))): time.time()}

        r.add(Gauge("vllm:lora_requests_info", "LoRA adapters in use by running and waiting requests (value: time).",
                    lora_info))
        self.prompt_tokens = r.add(Counter("vllm:prompt_tokens_total", "Prompt tokens processed."))
        self.generation_tokens = r.add(Counter("vllm:generation_tokens_total", "Tokens generated."))
        self.request_success = r.add(Counter("vllm:request_success_total", "Finished requests by finish reason."))
        # Histograms carry model_name as every vLLM metric does: its dashboards select on it.
        model = lambda: (("model_name", self.model_name),)  # noqa: E731

        def histogram(name: str, help: str, buckets: list[float]) -> Histogram:
            return r.add(Histogram(name, help, buckets, model))  # type: ignore[return-value]

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between tokens.", _LATENCY)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds", "Mean time per output token of a "
                              "request.", _LATENCY)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", _LATENCY)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", "First scheduled to first token.",
                                      _LATENCY)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "First token to finish.", _LATENCY)
        self.inference_time = histogram("vllm:request_inference_time_seconds", "First scheduled to finish.",
                                        _LATENCY)
        self.prompt_len = histogram("vllm:request_prompt_tokens", "Prompt length.", _LENGTHS)
        self.gen_len = histogram("vllm:request_generation_tokens", "Generated tokens per sequence.", _LENGTHS)
        self.params_n = histogram("vllm:request_params_n", "The n of finished requests.", _PARAMS_N)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens", "The max_tokens of finished requests.",
                                           _LENGTHS)
        self.step_tokens = histogram("vllm:iteration_tokens_total", "Tokens per engine step.", _STEP_TOKENS)
        self.step_time = histogram("streamer:step_time_seconds", "Measured step periods (scheduling to processed "
                                   "outputs).", _LATENCY)
        self.step_time_predicted = histogram("streamer:step_time_predicted_seconds", "The step-time model's "
                                             "prediction of each step's period.", _LATENCY)
        self.stalls = r.add(Counter("streamer:inter_token_stalls_total", f"Inter-token gaps over {STALL_FACTOR:g}x "
                                    "the median of recent gaps."))
        self._stalls = StallCounter()

    def render(self) -> str:
        return self.registry.render()

    def observe_timings(self, t: "TokenTimings") -> None:
        """The engine's token latencies since the last call (streamer/engine/output_processor.py TokenTimings)."""
        for seconds in t.ttft:
            self.ttft.observe(seconds)
        stalls = 0
        for seconds, count in t.itl.items():
            self.itl.observe(seconds, count)
            stalls += self._stalls.observe(seconds, count)
        if stalls:
            self.stalls.inc(stalls, model_name=self.model_name)
        for predicted, measured in t.steps:
            self.step_time.observe(measured)
            if predicted > 0:
                self.step_time_predicted.observe(predicted)
        if t.prompt_tokens:
            self.prompt_tokens.inc(t.prompt_tokens, model_name=self.model_name)
        for tokens in t.step_tokens:
            self.step_tokens.observe(tokens)

    def observe_finished(self, req: "Request", first_token: Optional[float], finished: float) -> None:
        """A finished sequence (each of a request's n): its latencies and lengths; the request's parameters once."""
        self.request_success.inc(finished_reason=req.finish_reason or "stop", model_name=self.model_name)
        output_tokens = req.num_output_tokens
        self.prompt_len.observe(req.num_prompt_tokens)
        self.gen_len.observe(output_tokens)
        self.e2e.observe(finished - req.arrival_time)
        if req.seq_index == 0:
            self.params_n.observe(req.params.n)
            self.params_max_tokens.observe(req.max_tokens)
        scheduled = req.first_scheduled_time
        if scheduled is not None:
            self.queue_time.observe(scheduled - req.arrival_time)
            self.inference_time.observe(finished - scheduled)
            if first_token is not None:
                self.prefill_time.observe(first_token - scheduled)
        if first_token is not None:
            self.decode_time.observe(finished - first_token)
            if output_tokens > 1:
                self.tpot.observe((finished - first_token) / (output_tokens - 1))


class StatsLogger:
    """vLLM's periodic log line: prompt and generation throughput over the last interval, running and waiting
    requests, KV cache usage and the interval's prefix-cache hit rate. Nothing is logged while the engine idles."""

    def __init__(self, metrics: EngineMetrics, stats: Callable[[], dict]) -> None:
        self.metrics, self.stats = metrics, stats
        self._last = (time.monotonic(), 0.0, 0.0, 0, 0)  # (time, prompt tokens, generated, cache hits, queries)

    def line(self) -> Optional[str]:
        """The line for the interval since the last call, or None when nothing ran and nothing waits."""
        now, st = time.monotonic(), self.stats()
        prompt = sum(self.metrics.prompt_tokens.values.values())
        generated = sum(self.metrics.generation_tokens.values.values())
        hits, queries = st["prefix_cache_hits"], st["prefix_cache_queries"]
        t0, prompt0, generated0, hits0, queries0 = self._last
        self._last = (now, prompt, generated, hits, queries)
        if prompt == prompt0 and generated == generated0 and not st["num_running"] and not st["num_waiting"]:
            return None
        dt = max(now - t0, 1e-9)
        hit_rate = 100.0 * (hits - hits0) / (queries - queries0) if queries > queries0 else 0.0
        return (f"Avg prompt throughput: {(prompt - prompt0) / dt:.1f} tokens/s, "
                f"Avg generation throughput: {(generated - generated0) / dt:.1f} tokens/s, "
                f"Running: {st['num_running']} reqs, Waiting: {st['num_waiting']} reqs, "
                f"KV cache usage: {100.0 * st['kv_cache_usage']:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%")
