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
import dataclasses
import itertools
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .answer import AnswerHooks, AnswerRecorder, Part
from .backend import Backend
from .collab import MODES, TEXT_MODE, AnswerRun, Mode, auto_mode
from .collab.auto import held
from .config import CollabSettings, EdgeCloudSettings, load_settings
from .errors import ConfigError, InvalidRequestError
from .fallback import Attempt, CircuitBreaker
from .observability.client_metrics import ClientMetrics
from .observability.cost import CostModel, CostTotals
from .observability.tracing import chat_span
from .redaction import RedactedBackend
from .registry import make_edge_backend
from .router.cascade import ConfidenceCheck
from .router.policy import RouteDecision, RoutePolicy
from .router.scorers import load_scorer
from .store.catalogue import draft_model_for
from .types import ChatCompletionChunk, ChatRequest, CostInfo, NoteCode, Usage

__all__ = ["Hybrid", "ModePlan", "make_edge_backend"]


@dataclass
class ModePlan:
    """How one answer will be written: the mode, the side that starts, and why (typed notes)."""

    mode: str
    target: str
    notes: list[tuple[NoteCode, str]] = field(default_factory=list)
    #: Whether ``collab="auto"`` chose the mode.
    auto: bool = False


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
        self._drafter: Backend | None = None
        # backends passed in belong to the caller: close() leaves them open
        self._owns_edge, self._owns_clouds = edge_backend is None, cloud_backends is None
        self._edge_configured = edge_backend is not None or settings.edge_model is not None
        # resolved once: the settings are fixed for the client's life, and each answer asks
        self._draft_name = (draft_model_for(settings.edge_model, settings.edge_draft_model)
                            if self._owns_edge and settings.edge_model is not None
                            and settings.edge_runtime == "llamacpp" else None)
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
                    self._edge = make_edge_backend(s.edge_runtime, s.edge_model, n_ctx=s.n_ctx, device=self._device,
                                                   cache=s.cache, kv_events=self.metrics.kv_cache_event,
                                                   speculate=s.edge_speculate)
        return self._edge

    def draft_model(self) -> str | None:
        """The file verified mode drafts with where it is not the edge model itself
        (``edge_draft_model``: ``auto`` is the drafter the catalogue names for ``edge_model``), else None."""
        return self._draft_name

    @property
    def drafter(self) -> Backend | None:
        """What verified mode drafts with: :meth:`draft_model`'s backend (created on first use,
        beside the edge's), else the edge's."""
        name = self._draft_name
        if name is None:
            return self.edge
        if self._drafter is None:
            with self._lock:
                if self._drafter is None:
                    s = self.settings
                    self._drafter = make_edge_backend(s.edge_runtime, name, n_ctx=s.n_ctx, device=self._device,
                                                      cache=s.cache, kv_events=self.metrics.kv_cache_event,
                                                      speculate=s.edge_speculate)
        return self._drafter

    def _drafter_attempt(self) -> Attempt:
        drafter = self.drafter
        assert drafter is not None
        return Attempt("edge", drafter, self.edge_breaker, "edge")  # one device: one circuit

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
        known = [b.n_ctx for b in (self._edge, self._drafter) if b is not None and b.n_ctx]
        if known and self.policy.edge_max_context is None:
            self.policy.edge_max_context = min(known)  # known once an edge model (or its drafter) is loaded
        only = None if self.clouds and self._edge_configured else ("edge" if not self.clouds else "cloud")
        decision = self.policy.decide(request, available=[only] if only else (available or ["edge", "cloud"]))
        if only is not None and not decision.pinned and not (only == "edge" and decision.local_only):
            why = "no cloud endpoint configured" if only == "edge" else "no edge model configured"
            decision = dataclasses.replace(decision, reason=f"{only} only: {why}", kind="only_side")
        return decision

    def plan_mode(self, request: ChatRequest, decision: RouteDecision) -> ModePlan:
        """How the sides share this answer (a mode of :data:`edgecloud.collab.MODES`), and why.

        Nothing is shared when one side is missing or privacy keeps the request on the device, nor
        for an answer held to a grammar (structured output, tool calls: a span would hand a half
        to another side's grammar). ``auto`` is the best mode the sides can run
        (:func:`edgecloud.collab.auto_mode`: verified, token or lead, by what the edge runtime and
        each endpoint were seen to do) for every answer the edge can start, also those the
        router's score would send to the cloud (the score does not carry over to unseen tasks; a
        shared mode reads the edge's own uncertainty while it writes). A pinned route
        (``route="edge"`` or ``"cloud"``) is that side alone, whatever the mode: collaboration is
        what ``route="auto"`` does. A prompt the edge cannot hold, or an edge that is down, start
        on the cloud. A mode that needs the edge's token logprobs falls back to one side
        under ``auto`` and is a ConfigError when asked for by name; a mode that cannot redact
        PII runs token mode under ``pii="redact"``.
        """
        asked = request.collab_options.mode or self.settings.collab.mode
        plain = ModePlan("off", decision.target)
        if decision.local_only or asked == "off" or not self.clouds or not self._edge_configured:
            return plain
        if held(request):  # verified checks hold both sides to the grammar; any other mode would split it
            tools = request.tool_mode.mode != "none"
            code: NoteCode = "tools_one_side" if tools else "structured_one_side"
            plain = ModePlan("off", decision.target, [(code, "an answer that may call tools is written by one side"
                                                       if tools else "structured output is written by one side")])
            if asked not in ("auto", "verified", "checked"):
                return plain
        if not self.edge_breaker.available() or decision.kind in ("context", "unavailable", "only_side"):
            return plain
        if decision.pinned:  # a pinned route is that side alone (the other only as its failover)
            return plain
        edge = self.edge
        auto = asked == "auto"
        why = ""
        if auto:
            if edge is None:
                return plain
            chosen, why = auto_mode(edge, self.clouds, redacted=decision.redaction is not None, request=request)
            if chosen is None:
                return ModePlan(plain.mode, plain.target, [(c, f"{t} ({why})") for c, t in plain.notes])
            asked = chosen
        wanted = MODES[asked]
        if wanted.middle_band_only:  # the cascade: an edge answer checked after the fact
            cascade = decision.cascade and self.settings.router.cascade and decision.target == "edge"
            return ModePlan(wanted.name, decision.target) if cascade else plain
        if edge is None:
            return plain
        if wanted.needs_logprobs and not edge.supports_logprobs:
            if asked == "auto":
                return plain
            raise ConfigError(f"collab={wanted.name!r} reads the edge's token logprobs; the {edge.name} runtime gives "
                              "none: use edge_runtime='llamacpp' or collab='off'")
        notes: list[tuple[NoteCode, str]] = []
        if decision.redaction is not None and not wanted.can_redact:
            notes.append(("pii_no_verify", f"{wanted.name} mode cannot redact PII (it sends token ids): "
                                           f"{TEXT_MODE} mode instead"))
            wanted = MODES[TEXT_MODE]
        if decision.target == "cloud" and not wanted.cloud_opens:
            notes.append(("edge_starts", "the edge starts and the cloud writes where it is unsure"))
        if auto:
            notes.append(("policy", f"collab=auto chose {wanted.name} mode: {why}"))
        return ModePlan(wanted.name, "edge", notes, auto=auto)

    def answer_settings(self, request: ChatRequest) -> CollabSettings:
        """The client's ``collab`` settings under the request's own (``collab={...}``)."""
        options = request.collab_options
        update = {k: v for k, v in options.model_dump(exclude={"mode"}).items() if v is not None}
        settings = self.settings.collab.model_copy(update=update) if update else self.settings.collab
        if settings.draft_max < settings.draft_min:
            raise InvalidRequestError(f"invalid 'collab.draft_max': {settings.draft_max} is below collab.draft_min "
                                      f"({settings.draft_min}); raise draft_max or lower draft_min",
                                      param="collab.draft_max")
        if request.max_tokens is not None and settings.draft_min > request.max_tokens:
            raise InvalidRequestError(f"invalid 'collab.draft_min': {settings.draft_min} tokens per check is more "
                                      f"than max_tokens ({request.max_tokens}); lower collab.draft_min",
                                      param="collab.draft_min")
        return settings

    def _attempts(self, decision: RouteDecision, target: str) -> list[Attempt]:
        clouds = self._cloud_attempts()
        if decision.redaction is not None and decision.messages is not None:
            clouds = [Attempt(a.side, RedactedBackend(a.backend, decision.redaction, decision.messages), a.breaker,
                              a.label) for a in clouds]
        edge = self._edge_attempt()
        cross = self.settings.fallback.enabled  # a pinned side is where to start, not a reason to fail
        if decision.local_only:
            return edge
        if target == "edge":
            return edge + (clouds if cross else [])
        return clouds + (edge if cross else [])

    # ------------------------------------------------------------------ the request

    def stream(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        run = _Run(self, request)
        with run.span() as span:
            run.attach(span)
            try:
                for chunk in run.mode.chunks(run.answer):
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
                async for chunk in run.mode.achunks(run.answer):
                    yield run.seen(chunk)
                run.ok = True
            except (GeneratorExit, asyncio.CancelledError):  # the caller closed the stream or was cancelled
                run.cancelled = True
                raise
            finally:
                run.end()

    # ------------------------------------------------------------------ accounting

    def _cost(self, parts: list[Part], usage: Usage | None = None) -> CostInfo:
        """Each part priced where it ran; the cloud equivalent on the request's own usage."""
        return self.costs.combine([
            self.costs.price_part(p.side, p.prompt_tokens, p.completion_tokens, p.seconds, cached_tokens=p.cached_tokens,
                                  calls=p.calls, passes=p.passes or None)
            for p in parts], usage)

    def _edge_name(self) -> str:
        model = self.settings.edge_model
        return os.path.basename(str(model)) if model is not None else "edge"

    def stats(self) -> dict[str, Any]:
        """Totals since the client started: requests per side, fallbacks, cost and saving; the
        circuits; and what each cloud endpoint was seen to accept (``clouds``)."""
        out = self.totals.snapshot()
        out["circuits"] = {"edge": self.edge_breaker.state,
                           **{b.name: b.state for b in self.cloud_breakers}}
        out["clouds"] = [c.capabilities.snapshot() for c in self.clouds if c.capabilities is not None]
        return out

    def load(self) -> None:
        """Load the edge model now (and the file verified mode drafts with, where a cloud is set
        and collaboration may verify), instead of on the first answer."""
        if self.edge is not None:
            self.edge.load()
        if self.clouds and self.settings.collab.mode in ("auto", "verified") and self._draft_name:
            drafter = self.drafter
            assert drafter is not None
            drafter.load()

    def close(self) -> None:
        """Close the backends this engine created (not ones the caller passed in)."""
        for edge in (self._edge, self._drafter):
            if edge is not None and self._owns_edge:
                edge.close()
        if self._owns_clouds:
            for cloud in self.clouds:
                cloud.close()

    async def aclose(self) -> None:
        """Async twin of :meth:`close`: closes the cloud clients' async connections too."""
        for edge in (self._edge, self._drafter):
            if edge is not None and self._owns_edge:
                await edge.aclose()
        if self._owns_clouds:
            for cloud in self.clouds:
                await cloud.aclose()


class _Run:
    """One request through :class:`Hybrid`: the plan, the answer's recorder, metrics, cost and span.

    Everything but the iteration itself, so that ``Hybrid.stream`` and ``Hybrid.astream`` differ
    only in ``for`` / ``async for``.
    """

    def __init__(self, hybrid: Hybrid, request: ChatRequest) -> None:
        hybrid.check(request)
        self.hybrid, self.request = hybrid, request
        self.started = time.perf_counter()
        self.decision = decision = hybrid.decide(request)
        plan = hybrid.plan_mode(request, decision)
        hooks = AnswerHooks(on_fallback=self.on_fallback, on_span=self.on_span, finalize=self.finalize)
        self.recorder = AnswerRecorder(target=plan.target, decided=(decision.kind, decision.reason),  # type: ignore[arg-type]
                                       score=decision.score, hooks=hooks)
        for code, text in plan.notes:
            self.recorder.note(code, text)
        hybrid.metrics.route(plan.target, decision.kind)
        self.model = hybrid._edge_name() if plan.target == "edge" else (hybrid.settings.cloud_model or "cloud")
        self.first_token: float | None = None
        self.final: ChatCompletionChunk | None = None
        self.ok = self.cancelled = False
        self._span: Any = None
        attempts = hybrid._attempts(decision, plan.target)
        mode = MODES[plan.mode]
        if mode.decides_while_writing and {a.side for a in attempts} != {"edge", "cloud"}:
            mode = MODES["off"]  # a cloud circuit is open: one side answers
        self.recorder.set_mode(mode.name)
        if mode.decides_while_writing:
            self.recorder.note("collab_mode", f"{mode.name} mode: {mode.describe}")
        self.mode: Mode = mode()
        settings = hybrid.settings
        self.answer = AnswerRun(request, attempts, hybrid.answer_settings(request), self.recorder,
                                mid_stream=settings.fallback.mid_stream, confidence=hybrid.confidence, auto=plan.auto,
                                redacted=self.decision.redaction is not None,
                                drafter=hybrid._drafter_attempt if hybrid._draft_name else None)

    def span(self) -> Any:
        """The request's OpenTelemetry span (a no-op without OpenTelemetry); :meth:`attach` it."""
        return chat_span(request_model=self.model, request=self.request, tracer_provider=self.hybrid.tracer_provider)

    def attach(self, span: Any) -> None:
        self._span = span
        route = self.recorder.route
        span.set_route(route.target, "", self.decision.reason, self.decision.score)

    def on_fallback(self, from_: str, to: str, cause: str, at_chars: int) -> None:
        self.hybrid.metrics.fallback(from_, to, cause)
        self._span.add_fallback(from_, to, cause, at_chars)

    def on_span(self, mode: str, outcome: str, cloud_tokens: int, seconds: float) -> None:
        self.hybrid.metrics.collab_span(mode, outcome)
        self._span.add_span_event(mode, outcome, cloud_tokens, seconds)

    def finalize(self, chunk: ChatCompletionChunk, parts: list[Part]) -> None:
        chunk.cost = self.hybrid._cost(parts, chunk.usage)
        self.final = chunk

    def seen(self, chunk: ChatCompletionChunk) -> ChatCompletionChunk:
        if self.first_token is None and chunk.text:
            self.first_token = time.perf_counter() - self.started
            self._span.ttft(self.first_token)
        return chunk

    def end(self) -> None:
        hybrid, route, last = self.hybrid, self.recorder.route, self.final
        cost = last.cost if last is not None else hybrid._cost(self.recorder.parts)
        hybrid.metrics.request(route.target, ttft=self.first_token, e2e=time.perf_counter() - self.started,
                               usage=last.usage if last else None, cost=cost, ok=self.ok, cancelled=self.cancelled)
        if self.ok and cost is not None:
            hybrid.totals.add(cost, route.target, fallbacks=len(route.fallbacks), tokens=route.tokens)
        if self.ok and self.mode.shared and route.tokens:
            hybrid.metrics.collab_answer(route.tokens)
        if last is not None:
            finish = last.choices[0].finish_reason if last.choices else None
            self._span.set_route(route.target, route.backend, route.reason, route.score)
            self._span.set_response(model=last.model, response_id=last.id, finish_reason=finish,
                                    usage=last.usage, cost=cost)


def settings_from(config: Any = None, **overrides: Any) -> EdgeCloudSettings:
    """Settings for a client: ``config`` (file, mapping or settings) under explicit arguments."""
    return load_settings(config, **{k: v for k, v in overrides.items() if v is not None})
