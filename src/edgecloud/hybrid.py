"""The hybrid engine behind EdgeCloud: settings → backends → route → failover → cost and telemetry.

This module owns :class:`Hybrid`, a :class:`~edgecloud.backend.Backend` whose ``stream``
answers one validated request the way the client promises:

1. **Conflicts** are refused before any backend is called (``route="cloud"`` with no cloud,
   ``route="edge"`` with no edge model, ``privacy="local_only"`` with ``route="cloud"``).
2. **Route**: the :class:`~edgecloud.router.policy.RoutePolicy` decides from the request and
   the sides that are configured and healthy (circuit breakers); with one side configured
   the reason says so.
3. **Cascade** (middle band of the score): the edge answers first, off-stream; the
   confidence check (:mod:`edgecloud.router.cascade`) either accepts it (it is replayed to the
   caller) or escalates to the cloud (``route.fallbacks`` records ``low_confidence``). Token
   logprobs are one of its signals where the edge runtime gives them
   (``Backend.supports_logprobs``); elsewhere the check fitted without them judges.
4. **Failover** (:class:`~edgecloud.fallback.FailoverStream`): the chosen side first, then
   the other cloud URLs (in order or round-robin), then the other side — unless privacy keeps
   the request local or ``fallback.enabled`` is off. ``route="edge"|"cloud"`` says where to
   start; a failure there still falls back (use ``privacy="local_only"`` to forbid the cloud).
   Also mid-stream.
5. **Cost, metrics, spans**: the last chunk carries ``usage``, ``route`` and ``cost``; the
   totals are in :meth:`Hybrid.stats`, Prometheus series in ``metrics``, OpenTelemetry spans
   when a tracer provider is configured or installed globally.

PII under ``pii="redact"``: the cloud sees placeholders and the caller the restored text
(restored while streaming); the edge always sees the original conversation.

``stream`` and ``astream`` are twins: the async path calls each backend's ``astream`` (the HTTP
cloud client natively, without a thread; a synchronous edge runtime on the bounded worker pool
of :mod:`edgecloud.backend`), and shares every decision with the sync path.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from .backend import Backend, iterate_in_worker
from .config import EDGE_RUNTIMES, EdgeCloudSettings, load_settings
from .errors import ConfigError, InvalidRequestError
from .fallback import Attempt, CircuitBreaker, FailoverStream, Part

if TYPE_CHECKING:
    from .collab import CollabRun
from .observability.client_metrics import ClientMetrics
from .observability.cost import CostModel, CostTotals
from .observability.tracing import chat_span
from .router.cascade import ConfidenceCheck, signals
from .router.pii import Redaction, StreamingRestore
from .router.policy import RouteDecision, RoutePolicy
from .router.scorers import load_scorer
from .types import ChatCompletionChunk, ChatMessage, ChatRequest, CostInfo, RouteInfo, Usage, collect_chunks

__all__ = ["Hybrid", "make_edge_backend"]


def make_edge_backend(runtime: str, model: str, *, n_ctx: int | None = None, device: str = "this") -> Backend:
    """The edge backend for ``runtime`` (llamacpp, torch or onnx); nothing heavy is imported before it is asked for.

    ``model`` is a catalogue name or GGUF path, or for ``onnx`` an ``edgecloud export onnx`` folder
    (checked here, so a folder that is not an export fails before anything loads).
    """
    if runtime == "torch":
        from .edge.torch import TorchBackend

        return TorchBackend(model, n_ctx=n_ctx)
    if runtime == "onnx":
        from .edge.onnx import OnnxBackend, load_manifest

        load_manifest(model)
        return OnnxBackend(model, n_ctx=n_ctx, device=device)
    if runtime == "llamacpp":
        from .edge.llamacpp import LlamaCppBackend

        return LlamaCppBackend(model, n_ctx=n_ctx, device=device)
    raise ConfigError(f"unknown edge runtime {runtime!r}; use {', '.join(EDGE_RUNTIMES)}")

Side = Literal["edge", "cloud"]


class _Redacted(Backend):
    """A cloud backend seen through a redaction: placeholders out, originals back in."""

    target: ClassVar[Side] = "cloud"

    def __init__(self, inner: Backend, redaction: Redaction, messages: list[dict[str, str]]) -> None:
        self.inner, self.redaction, self.messages = inner, redaction, messages
        self.name = inner.name  # type: ignore[misc]
        self.model_name, self.n_ctx, self.base_url = inner.model_name, inner.n_ctx, inner.base_url
        self.supports_logprobs = inner.supports_logprobs  # type: ignore[misc]
        self.supports_continuation = inner.supports_continuation  # type: ignore[misc]

    def _redacted(self, request: ChatRequest) -> ChatRequest:
        redacted = [ChatMessage(role=m["role"], content=m["content"]) for m in self.messages]
        extra = request.messages[len(self.messages):]  # a partial answer being continued
        if extra:
            originals = {v: k for k, v in self.redaction.mapping.items()}
            for message in extra:
                text = message.content
                for value, placeholder in originals.items():
                    text = text.replace(value, placeholder)
                redacted.append(ChatMessage(role=message.role, content=text))
        return request.model_copy(update={"messages": redacted})

    @staticmethod
    def _restore(chunk: ChatCompletionChunk, restore: StreamingRestore) -> ChatCompletionChunk:
        for choice in chunk.choices:
            if choice.delta.content:
                choice.delta.content = restore.push(choice.delta.content)
            if choice.finish_reason is not None:
                choice.delta.content = (choice.delta.content or "") + restore.flush()
        return chunk

    def stream(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        restore = StreamingRestore(self.redaction)
        for chunk in self.inner.stream(self._redacted(request)):
            yield self._restore(chunk, restore)

    async def astream(self, request: ChatRequest) -> AsyncIterator[ChatCompletionChunk]:
        restore = StreamingRestore(self.redaction)
        async for chunk in self.inner.astream(self._redacted(request)):
            yield self._restore(chunk, restore)


class Hybrid(Backend):
    """Route, fail over, price and trace every request (see the module docstring)."""

    name: ClassVar[str] = "edgecloud"

    def __init__(
        self,
        settings: EdgeCloudSettings,
        *,
        edge_backend: Backend | None = None,
        cloud_backends: Sequence[Backend] | None = None,
        policy: RoutePolicy | None = None,
        confidence: ConfidenceCheck | None = None,
        metrics: ClientMetrics | None = None,
        tracer_provider: Any = None,
        device: str = "this",
    ) -> None:
        self.settings = settings
        fb = settings.fallback
        self._edge = edge_backend
        # backends passed in belong to the caller: close() leaves them open
        self._owns_edge, self._owns_clouds = edge_backend is None, cloud_backends is None
        self._edge_configured = edge_backend is not None or settings.edge_model is not None
        self._device = device
        self._lock = threading.Lock()
        if cloud_backends is not None:
            self.clouds = list(cloud_backends)
        else:
            self.clouds = [self._cloud_backend(url) for url in settings.cloud_base_url]
        breaker = {"failure_threshold": fb.failure_threshold, "cooldown_s": fb.cooldown_s}
        self.edge_breaker = CircuitBreaker("edge", **breaker)
        self.cloud_breakers = [CircuitBreaker(c.base_url or f"cloud{i}", **breaker)
                               for i, c in enumerate(self.clouds)]
        if policy is None:
            r = settings.router
            policy = RoutePolicy(
                scorer=load_scorer(r.scorer, r.scorer_path), edge_below=r.edge_below, cloud_above=r.cloud_above,
                target_cloud_fraction=r.target_cloud_fraction, pii=r.pii, edge_max_context=settings.n_ctx,
            )
        self.policy = policy
        self.confidence = confidence or ConfidenceCheck.packaged()
        self.costs = CostModel(settings.prices)
        self.totals = CostTotals()
        self.metrics = metrics or ClientMetrics()
        self.tracer_provider = tracer_provider
        self._round_robin = itertools.count()

    # ------------------------------------------------------------------ backends

    def _cloud_backend(self, url: str) -> Backend:
        from .remote.client import CloudBackend

        s, fb = self.settings, self.settings.fallback
        if not s.cloud_model:
            raise ConfigError("cloud_base_url is set but cloud_model is not: name the model the endpoint serves "
                              "(cloud_model=... or EDGECLOUD_CLOUD_MODEL)")
        key = s.cloud_api_key.get_secret_value() if s.cloud_api_key is not None else None
        return CloudBackend(url, s.cloud_model, api_key=key, connect_timeout=fb.connect_timeout_s,
                            read_timeout=fb.timeout_s, max_retries=fb.max_retries, backoff=fb.backoff_s)

    @property
    def edge(self) -> Backend | None:
        """The on-device backend (created on first use), or None when no edge model is configured."""
        if self._edge is None and self.settings.edge_model is not None:
            with self._lock:
                if self._edge is None:
                    s = self.settings
                    self._edge = make_edge_backend(s.edge_runtime, s.edge_model, n_ctx=s.n_ctx, device=self._device)
        return self._edge

    def _cloud_attempts(self) -> list[Attempt]:
        attempts = [Attempt("cloud", c, b, c.base_url or c.name) for c, b in zip(self.clouds, self.cloud_breakers)]
        if self.settings.fallback.cloud_order == "round_robin" and attempts:
            start = next(self._round_robin) % len(attempts)
            attempts = attempts[start:] + attempts[:start]
        return attempts

    def _edge_attempt(self) -> list[Attempt]:
        edge = self.edge
        return [Attempt("edge", edge, self.edge_breaker, "edge")] if edge is not None else []

    # ------------------------------------------------------------------ routing

    def check(self, request: ChatRequest) -> None:
        """Refuse settings that contradict each other, before any backend runs."""
        if not self.clouds and not self._edge_configured:
            raise ConfigError("neither an edge model nor a cloud endpoint is configured; set edge_model and/or "
                              "cloud_base_url (arguments, EDGECLOUD_* or edgecloud.toml)")
        if request.route == "cloud" and not self.clouds:
            raise InvalidRequestError("route='cloud' was asked but no cloud endpoint is configured; set "
                                      "cloud_base_url or use route='auto'/'edge'", param="route")
        if request.route == "edge" and not self._edge_configured:
            raise InvalidRequestError("route='edge' was asked but no edge model is configured; set edge_model "
                                      "or use route='auto'/'cloud'", param="route")
        if request.privacy == "local_only" and request.route == "cloud":
            raise InvalidRequestError("privacy='local_only' and route='cloud' conflict: a local-only request "
                                      "never leaves the device; drop one of them", param="route")

    def decide(self, request: ChatRequest) -> RouteDecision:
        """Where this request goes first, and why."""
        available = []
        if self._edge_configured and self.edge_breaker.available():
            available.append("edge")
        if any(b.available() for b in self.cloud_breakers):
            available.append("cloud")
        edge = self._edge
        if edge is not None and self.policy.edge_max_context is None and edge.n_ctx:
            self.policy.edge_max_context = edge.n_ctx  # known once the edge model is loaded
        if not self.clouds:
            decision = self.policy.decide(request, available=["edge"])
            if not decision.local_only and not decision.pinned:
                decision.reason, decision.kind = "edge only: no cloud endpoint configured", "only_side"
            return decision
        if not self._edge_configured:
            decision = self.policy.decide(request, available=["cloud"])
            if not decision.pinned:
                decision.reason, decision.kind = "cloud only: no edge model configured", "only_side"
            return decision
        return self.policy.decide(request, available=available or ["edge", "cloud"])

    def collab_mode(self, request: ChatRequest, decision: RouteDecision) -> str:
        """How the sides share this answer: ``off``, ``token``, ``verified`` or ``cascade``.

        Nothing is shared when one side is missing or privacy keeps the request on the device.
        ``auto`` runs token mode for every answer the edge can start, also those the router's
        score would send to the cloud (the score does not carry over to unseen tasks; the
        gate reads the edge's own uncertainty while it writes): only ``route="cloud"``, a
        prompt the edge cannot hold, or an edge that is down start on the cloud
        (``route="edge"`` says where to start, so it collaborates too). An explicit ``token``
        or ``verified`` likewise. ``verified`` cannot redact (it sends token ids), so
        under ``pii="redact"`` it runs token mode.
        """
        mode = request.collab or self.settings.collab.mode
        if decision.local_only or mode == "off" or not self.clouds or not self._edge_configured:
            return "off"
        if _structured(request):
            # a span would restart the other side's grammar mid-answer: one side writes it
            decision.reason += "; structured output is written by one side"
            return "off"
        if request.tool_mode.mode != "none":
            # a span could cut a call's JSON in two, each half under a different side's grammar
            decision.reason += "; an answer that may call tools is written by one side"
            return "off"
        if not self.edge_breaker.available() or decision.kind in ("context", "unavailable", "only_side"):
            return "off"
        if decision.pinned and decision.target == "cloud":
            return "off"
        if mode == "cascade":
            return "cascade" if decision.cascade and self.settings.router.cascade and decision.target == "edge" else "off"
        edge = self.edge
        if edge is None:
            return "off"
        if not edge.supports_logprobs and mode != "verified":
            if mode == "auto":
                return "off"
            raise ConfigError(f"collab='token' reads the edge's token logprobs; the {edge.name} runtime gives none: "
                              "use edge_runtime='llamacpp' or collab='off'")
        if mode == "verified" and decision.redaction is not None:
            decision.reason += "; verified mode cannot redact PII (it sends token ids): token mode instead"
            mode = "token"
        if decision.target == "cloud":
            decision.target = "edge"
            decision.reason += "; the edge starts and the cloud writes where it is unsure"
        return "token" if mode == "auto" else mode

    def _attempts(self, decision: RouteDecision, request: ChatRequest) -> list[Attempt]:
        clouds = self._cloud_attempts()
        if decision.redaction is not None and decision.messages is not None:
            clouds = [Attempt(a.side, _Redacted(a.backend, decision.redaction, decision.messages), a.breaker, a.label)
                      for a in clouds]
        edge = self._edge_attempt()
        cross = self.settings.fallback.enabled  # a pinned side is where to start, not a reason to fail
        if decision.local_only:
            return edge
        if decision.target == "edge":
            return edge + (clouds if cross else [])
        return clouds + (edge if cross else [])

    # ------------------------------------------------------------------ the request

    def stream(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        run = _Run(self, request)
        with run.span() as span:
            run.attach(span)
            try:
                for chunk in run.chunks_sync():
                    yield run.seen(chunk)
                run.ok = True
            except GeneratorExit:  # the caller closed the stream early
                run.cancelled = True
                raise
            finally:
                run.end()

    async def astream(self, request: ChatRequest) -> AsyncIterator[ChatCompletionChunk]:
        run = _Run(self, request)
        with run.span() as span:
            run.attach(span)
            try:
                async for chunk in run.chunks_async():
                    yield run.seen(chunk)
                run.ok = True
            except (GeneratorExit, asyncio.CancelledError):  # the caller closed the stream or was cancelled
                run.cancelled = True
                raise
            finally:
                run.end()

    def _judge(self, request: ChatRequest, route: RouteInfo, attempts: list[Attempt], first: FailoverStream,
               buffered: list[ChatCompletionChunk], on_fallback: Any, finalize: Any) -> FailoverStream | list[ChatCompletionChunk]:
        """The cascade's verdict on a buffered edge answer: the chunks to replay, or the cloud stream."""
        answered_on = first.parts[-1].side if first.parts else "edge"
        if answered_on != "edge" or not buffered:
            return buffered
        answer = collect_chunks(buffered)
        edge = next(a.backend for a in attempts if a.side == "edge")
        logprobs = [e.logprob for e in answer.choices[0].logprobs.content] if answer.choices[0].logprobs else []
        prompt = next((m.content for m in reversed(request.messages) if m.role == "user"), "")
        sig = signals(prompt, answer.text, finish_reason=answer.choices[0].finish_reason, logprobs=logprobs,
                      route_score=route.score)
        check = self.confidence.for_backend(edge.supports_logprobs)
        p_good = check.p_good(sig)
        if p_good >= check.threshold:
            route.reason += f"; edge answer accepted (confidence {p_good:.2f})"
            if not request.logprobs:
                for chunk in buffered:
                    for choice in chunk.choices:
                        choice.logprobs = None
            buffered[-1].route = first.snapshot()  # the final chunk carries the complete route
            return buffered
        clouds = [a for a in attempts if a.side == "cloud"]
        route.fallbacks.append({"from": "edge", "to": "cloud", "cause": "low_confidence",
                                "error": f"edge answer confidence {p_good:.2f} < {check.threshold}",
                                "at_chars": 0})
        on_fallback("edge", "cloud", "low_confidence", 0)
        final_parts = list(first.parts)
        return FailoverStream(clouds, request, route, self.settings.fallback.mid_stream, on_fallback,
                              lambda chunk, done: finalize(chunk, final_parts + done))

    # ------------------------------------------------------------------ accounting

    def _cost(self, parts: list[Part], usage: Usage | None = None) -> CostInfo:
        """Each part priced where it ran; the cloud equivalent on the request's own usage."""
        return self.costs.combine(
            [self.costs.price_part(p.side, p.prompt_tokens, p.completion_tokens, p.seconds) for p in parts], usage
        )

    def _edge_name(self) -> str:
        model = self.settings.edge_model
        return os.path.basename(str(model)) if model is not None else "edge"

    def stats(self) -> dict[str, Any]:
        """Totals since the client started: requests per side, fallbacks, cost and saving."""
        out = self.totals.snapshot()
        out["circuits"] = {"edge": self.edge_breaker.state,
                           **{b.name: b.state for b in self.cloud_breakers}}
        return out

    def load(self) -> None:
        if self.edge is not None:
            self.edge.load()

    def close(self) -> None:
        """Close the backends this engine created (not ones the caller passed in)."""
        if self._edge is not None and self._owns_edge:
            self._edge.close()
        if self._owns_clouds:
            for cloud in self.clouds:
                cloud.close()

    async def aclose(self) -> None:
        """Async twin of :meth:`close`: closes the cloud clients' async connections too."""
        if self._edge is not None and self._owns_edge:
            await self._edge.aclose()
        if self._owns_clouds:
            for cloud in self.clouds:
                await cloud.aclose()


class _Run:
    """One request through :class:`Hybrid`: route, the chunk sources, metrics, cost and span.

    Everything but the iteration itself, so that ``Hybrid.stream`` and ``Hybrid.astream`` differ
    only in ``for`` / ``async for``.
    """

    def __init__(self, hybrid: Hybrid, request: ChatRequest) -> None:
        hybrid.check(request)
        self.hybrid, self.request = hybrid, request
        self.started = time.perf_counter()
        self.decision = decision = hybrid.decide(request)
        self.collab = hybrid.collab_mode(request, decision)
        self.route = RouteInfo(target=decision.target, backend="", reason=decision.reason, score=decision.score,
                               collab=self.collab)
        hybrid.metrics.route(decision.target, decision.kind)
        self.model = hybrid._edge_name() if decision.target == "edge" else (hybrid.settings.cloud_model or "cloud")
        self.parts: list[Part] = []
        self.first_token: float | None = None
        self.final: ChatCompletionChunk | None = None
        self.ok = self.cancelled = False
        self._span: Any = None
        self.attempts = hybrid._attempts(decision, request)
        if self.collab in ("token", "verified") and {a.side for a in self.attempts} != {"edge", "cloud"}:
            self.collab = self.route.collab = "off"  # a cloud circuit is open: one side answers
        self.cascade = self.collab == "cascade"

    def span(self) -> Any:
        """The request's OpenTelemetry span (a no-op without OpenTelemetry); :meth:`attach` it."""
        return chat_span(request_model=self.model, request=self.request, tracer_provider=self.hybrid.tracer_provider)

    def attach(self, span: Any) -> None:
        self._span = span
        span.set_route(self.decision.target, "", self.decision.reason, self.decision.score)

    def on_fallback(self, from_: str, to: str, cause: str, at_chars: int) -> None:
        self.hybrid.metrics.fallback(from_, to, cause)
        self._span.add_fallback(from_, to, cause, at_chars)

    def finalize(self, chunk: ChatCompletionChunk, done: list[Part]) -> None:
        self.parts[:] = done
        if self.route.tokens is None or self.collab in ("off", "cascade"):
            # who wrote how much, from the parts (a collaborative run counts as it goes)
            tokens = {"edge": 0, "cloud": 0}
            for part in done:
                tokens[part.side] += part.completion_tokens
            self.route.tokens, self.route.cloud_calls = tokens, sum(p.side == "cloud" for p in done)
            if chunk.route is not None:
                chunk.route.tokens, chunk.route.cloud_calls = dict(tokens), self.route.cloud_calls
        chunk.cost = self.hybrid._cost(self.parts, chunk.usage)
        self.final = chunk

    def on_span(self, mode: str, outcome: str, cloud_tokens: int, seconds: float) -> None:
        self.hybrid.metrics.collab_span(mode, outcome)
        self._span.add_span_event(mode, outcome, cloud_tokens, seconds)

    def _collab(self) -> CollabRun:
        """The collaborative run for this request (token or verified mode)."""
        from .collab import CollabHooks, TokenCollab, VerifiedCollab

        edge = next(a.backend for a in self.attempts if a.side == "edge")
        clouds = [a for a in self.attempts if a.side == "cloud"]
        hooks = CollabHooks(on_fallback=self.on_fallback, finalize=self.finalize, on_span=self.on_span)
        kind = TokenCollab if self.collab == "token" else VerifiedCollab
        self.route.reason += f"; {self.collab} mode: the edge writes, the cloud " + (
            "writes spans where the edge is unsure" if self.collab == "token" else "verifies its drafts")
        return kind(self.request, edge, clouds, self.hybrid.settings.collab, self.route, hooks)

    def _stream(self, attempts: list[Attempt], request: ChatRequest) -> FailoverStream:
        # a structured answer cannot be continued by another side's grammar: after text, a failure is raised
        mid_stream = self.hybrid.settings.fallback.mid_stream and not _structured(request)
        return FailoverStream(attempts, request, self.route, mid_stream, self.on_fallback, self.finalize)

    def _probe(self) -> ChatRequest:
        """The cascade's edge request: with logprobs when the edge runtime gives them (a signal)."""
        edge = next(a.backend for a in self.attempts if a.side == "edge")
        if self.request.logprobs or not edge.supports_logprobs:
            return self.request
        return self.request.model_copy(update={"logprobs": True})

    def chunks_sync(self) -> Iterable[ChatCompletionChunk]:
        if self.collab in ("token", "verified"):
            yield from self._collab().chunks()
            return
        if not self.cascade:
            yield from self._stream(self.attempts, self.request)
            return
        first = self._stream(self.attempts, self._probe())
        verdict = self.hybrid._judge(self.request, self.route, self.attempts, first, list(first),
                                     self.on_fallback, self.finalize)
        yield from verdict

    async def chunks_async(self) -> AsyncIterator[ChatCompletionChunk]:
        if self.collab in ("token", "verified"):
            # the edge decodes on a worker thread anyway: the whole collaborative loop runs there
            run = self._collab()
            async for chunk in iterate_in_worker(run.chunks):
                yield chunk
            return
        if not self.cascade:
            async for chunk in self._stream(self.attempts, self.request):
                yield chunk
            return
        first = self._stream(self.attempts, self._probe())
        buffered = [chunk async for chunk in first]
        verdict = self.hybrid._judge(self.request, self.route, self.attempts, first, buffered,
                                     self.on_fallback, self.finalize)
        if isinstance(verdict, FailoverStream):
            async for chunk in verdict:
                yield chunk
        else:
            for chunk in verdict:
                yield chunk

    def seen(self, chunk: ChatCompletionChunk) -> ChatCompletionChunk:
        if self.first_token is None and chunk.text:
            self.first_token = time.perf_counter() - self.started
            self._span.ttft(self.first_token)
        return chunk

    def end(self) -> None:
        hybrid, route, last = self.hybrid, self.route, self.final
        cost = last.cost if last is not None else hybrid._cost(self.parts)
        hybrid.metrics.request(route.target, ttft=self.first_token, e2e=time.perf_counter() - self.started,
                               usage=last.usage if last else None, cost=cost, ok=self.ok, cancelled=self.cancelled)
        if self.ok and cost is not None:
            hybrid.totals.add(cost, route.target, fallbacks=len(route.fallbacks), tokens=route.tokens)
        if self.ok and self.collab in ("token", "verified") and route.tokens:
            hybrid.metrics.collab_answer(route.tokens)
        if last is not None:
            finish = last.choices[0].finish_reason if last.choices else None
            self._span.set_route(route.target, route.backend, route.reason, route.score)
            self._span.set_response(model=last.model, response_id=last.id, finish_reason=finish,
                                    usage=last.usage, cost=cost)


def _structured(request: ChatRequest) -> bool:
    """Whether the answer is held to a grammar (``response_format`` json_object / json_schema)."""
    fmt = request.response_format
    return bool(fmt) and fmt.get("type") != "text"


def settings_from(config: Any = None, **overrides: Any) -> EdgeCloudSettings:
    """Settings for a client: ``config`` (file, mapping or settings) under explicit arguments."""
    return load_settings(config, **{k: v for k, v in overrides.items() if v is not None})
