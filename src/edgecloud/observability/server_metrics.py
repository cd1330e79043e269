"""The serving metrics of ``edgecloud serve``, in Prometheus text format.

This module owns :class:`ServerMetrics`: one private ``CollectorRegistry`` per server (so
two servers in one process, or tests, never share counters) holding vLLM's serving metrics
under an ``edgecloud:`` prefix:

=========================================  =========  ======================================
name                                       kind       meaning
=========================================  =========  ======================================
``edgecloud:time_to_first_token_seconds``  histogram  arrival -> first generated token
``edgecloud:inter_token_latency_seconds``  histogram  gap between consecutive tokens
``edgecloud:e2e_request_latency_seconds``  histogram  arrival -> finished
``edgecloud:num_requests_running``         gauge      sequences in the running batch
``edgecloud:num_requests_waiting``         gauge      sequences queued for a batch slot
``edgecloud:prompt_tokens_total``          counter    prompt tokens of admitted requests
``edgecloud:generation_tokens_total``      counter    tokens generated
``edgecloud:prefix_cache_queries_total``   counter    prompt tokens looked up in the prefix cache
                                                      (generation and scoring requests alike)
``edgecloud:prefix_cache_hits_total``      counter    of those, tokens whose KV was reused
``edgecloud:request_success_total``        counter    finished requests, by ``finished_reason``
``edgecloud:forward_passes_total``         counter    forward passes of the model (decode steps,
                                                      prefill chunks, scoring passes): the
                                                      self-hosted cost of what was served
``edgecloud:session_context_tokens_total`` counter    context tokens token sessions held, so
                                                      requests did not send them again
``edgecloud:engine_failures_total``        counter    engine failures, by ``scope``: ``sequence``
                                                      (one request failed, the rest went on),
                                                      ``step`` (a forward pass failed its batch),
                                                      ``scheduler`` (the loop died; restarted)
=========================================  =========  ======================================

With speculative decoding on (``edgecloud serve --spec ...``), vLLM's ``spec_decode`` set, by
``proposer`` (``draft`` or ``ngram``):

=====================================================  =======  ==================================
``edgecloud:spec_decode_num_drafts_total``             counter  verifications of a draft
``edgecloud:spec_decode_num_draft_tokens_total``       counter  tokens proposed
``edgecloud:spec_decode_num_accepted_tokens_total``    counter  of those, tokens the target kept
``edgecloud:spec_decode_num_accepted_tokens_per_pos``  counter  accepted tokens by draft position
``edgecloud:spec_decode_draft_failures_total``         counter  proposer errors (speculation is
                                                                dropped for those sequences)
``edgecloud:spec_decode_k``                            gauge    mean k chosen in the last step
=====================================================  =======  ==================================

Acceptance rate is ``accepted / draft_tokens``; mean acceptance length ``accepted / drafts``.

With a KV store for the llama.cpp engine's slots (``edgecloud serve --kv-ram-mib``),
``edgecloud:kv_cache_events_total{tier, event}`` counts its saves, hits, evictions and the
faults it recovered from by recomputing (as the client's series of the same name).

As in vLLM, the prefix-cache counters count tokens, so ``hits / queries`` is the hit rate.
The scheduler calls the ``on_*`` hooks from its own thread; prometheus_client's metrics are
thread-safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

#: ``Content-Type`` of :meth:`ServerMetrics.render`.
CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIX = "edgecloud:"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 51.2, 102.4)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class ServerMetrics:
    """vLLM-named serving metrics for one model server; ``render()`` is the ``/metrics`` body."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token.", labels, buckets=_TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between tokens.", labels, buckets=_ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "End-to-end request latency.", labels, buckets=_E2E_BUCKETS, registry=r
        )
        self.running = Gauge(PREFIX + "num_requests_running", "Requests in the running batch.", labels, registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting for a batch slot.", labels, registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens admitted.", labels, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", labels, registry=r)
        self.prefix_queries = Counter(
            PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels, registry=r
        )
        self.prefix_hits = Counter(
            PREFIX + "prefix_cache_hits", "Prompt tokens served from the prefix cache.", labels, registry=r
        )
        self.success = Counter(
            PREFIX + "request_success", "Finished requests.", [*labels, "finished_reason"], registry=r
        )
        self.forward_passes = Counter(
            PREFIX + "forward_passes", "Forward passes of the model (decode steps, prefill chunks, scoring).", labels,
            registry=r,
        )
        self.session_context = Counter(
            PREFIX + "session_context_tokens", "Context tokens token sessions held (not sent again).", labels,
            registry=r,
        )
        spec = [*labels, "proposer"]
        self.spec_drafts = Counter(PREFIX + "spec_decode_num_drafts", "Draft verifications.", spec, registry=r)
        self.spec_draft_tokens = Counter(PREFIX + "spec_decode_num_draft_tokens", "Draft tokens proposed.", spec, registry=r)
        self.spec_accepted = Counter(
            PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec, registry=r
        )
        self.spec_accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position.", [*spec, "position"],
            registry=r,
        )
        self.spec_failures = Counter(
            PREFIX + "spec_decode_draft_failures", "Proposer errors (those sequences continue without drafts).", spec,
            registry=r,
        )
        self.spec_k = Gauge(PREFIX + "spec_decode_k", "Mean draft length chosen in the last step.", labels, registry=r)
        self.kv_cache_events = Counter(
            PREFIX + "kv_cache_events", "Saved KV of the engine's slots, by tier and event.", [*labels, "tier", "event"],
            registry=r,
        )
        self.engine_failures = Counter(
            PREFIX + "engine_failures", "Engine failures by scope (sequence, step, scheduler).", [*labels, "scope"],
            registry=r,
        )
        for metric in (self.running, self.waiting, self.prompt_tokens, self.generation_tokens, self.prefix_queries,
                       self.prefix_hits, self.forward_passes, self.session_context):
            metric.labels(model_name)  # present (at 0) from the start, as scrapers expect

    # ------------------------------------------------------------------ hooks (scheduler thread)

    def set_queue(self, running: int, waiting: int) -> None:
        """Current batch and queue sizes."""
        self.running.labels(self.model_name).set(running)
        self.waiting.labels(self.model_name).set(waiting)

    def on_admitted(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A request joined the batch; ``cached_tokens`` of its prompt came from the prefix cache."""
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        self.prefix_queries.labels(self.model_name).inc(prompt_tokens)
        self.prefix_hits.labels(self.model_name).inc(cached_tokens)

    def on_token(self, first: bool, seconds: float) -> None:
        """A token was generated ``seconds`` after the request arrived (first) or after the previous token."""
        self.generation_tokens.labels(self.model_name).inc()
        (self.ttft if first else self.itl).labels(self.model_name).observe(seconds)

    def on_finished(self, reason: str, seconds: float) -> None:
        """A request ended (``stop``, ``length``, ``cancelled``, ``error``) ``seconds`` after arriving."""
        self.success.labels(self.model_name, reason).inc()
        self.e2e.labels(self.model_name).observe(seconds)

    def on_forward(self, passes: int = 1) -> None:
        """The engine ran ``passes`` forward passes (one decode step of a batch counts once)."""
        self.forward_passes.labels(self.model_name).inc(passes)

    def on_scored(self, prompt_tokens: int, context_tokens: int, generated: int, seconds: float,
                  cached_tokens: int = 0) -> None:
        """A scoring request (``echo`` + ``logprobs``) was answered: ``prompt_tokens`` sent (looked up
        in the prefix cache; ``cached_tokens`` of them read from it), ``context_tokens`` held by its
        session (neither sent nor looked up), ``generated`` greedy next tokens (0 or 1)."""
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        self.prefix_queries.labels(self.model_name).inc(prompt_tokens)
        self.prefix_hits.labels(self.model_name).inc(cached_tokens)
        self.session_context.labels(self.model_name).inc(context_tokens)
        self.generation_tokens.labels(self.model_name).inc(generated)
        self.on_finished("length", seconds)

    def on_draft(self, proposer: str, proposed: int, accepted: int) -> None:
        """One verification: ``accepted`` of ``proposed`` draft tokens kept."""
        self.spec_drafts.labels(self.model_name, proposer).inc()
        self.spec_draft_tokens.labels(self.model_name, proposer).inc(proposed)
        self.spec_accepted.labels(self.model_name, proposer).inc(accepted)
        for position in range(accepted):
            self.spec_accepted_per_pos.labels(self.model_name, proposer, str(position)).inc()

    def on_draft_failure(self, proposer: str) -> None:
        """The proposer raised; its sequences go on without speculation."""
        self.spec_failures.labels(self.model_name, proposer).inc()

    def on_kv_event(self, tier: str, event: str) -> None:
        """One event of the slots' KV store (``tier`` ram/disk; ``event`` save, hit, evict, corrupt ...)."""
        self.kv_cache_events.labels(self.model_name, tier, event).inc()

    def on_engine_failure(self, scope: str) -> None:
        """The engine failed: one ``sequence``, a whole ``step``, or the ``scheduler`` loop."""
        self.engine_failures.labels(self.model_name, scope).inc()

    def set_spec_k(self, mean_k: float) -> None:
        """Mean k over the sequences of the last step."""
        self.spec_k.labels(self.model_name).set(mean_k)

    # ------------------------------------------------------------------ exposition

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
