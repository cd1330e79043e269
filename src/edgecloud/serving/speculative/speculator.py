"""The speculation side of one scheduler: per-step drafting for the batch, verification, bookkeeping.

This module owns :class:`Speculator`. The :class:`~edgecloud.serving.scheduler.Scheduler` calls
it around each forward:

1. :meth:`Speculator.draft` — for every decoding sequence, its :class:`SpecState` picks a
   proposer and ``k`` from the live cost model (the step's predicted time for the planned
   rows, each proposer's measured seconds per draft token, the batch size); proposals are
   made per proposer in one call for all its sequences. A proposer that raises is counted
   and dropped for those sequences, which go on decoding plainly: a draft never fails a request.
2. the scheduler runs one forward with ``1 + k`` rows for each speculating sequence;
3. :meth:`Speculator.verify` — accepts a prefix of each draft (greedy match or exact rejection
   sampling), updates acceptance estimates, counters and metrics, and returns the tokens to
   emit; the scheduler truncates the KV cache to the accepted length;
4. :meth:`Speculator.observe_step` — feeds the step's time to the cost model.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...errors import ConfigError
from ...observability.server_metrics import ServerMetrics
from ...runtime.spec_control import Acceptance, SpecConfig, SpecState, StepCost
from .proposers import DraftRequest, Proposal, Proposer

if TYPE_CHECKING:
    import torch

    from .verify import Verdict

__all__ = ["DraftSlot", "Planned", "Speculator"]

#: What the scheduler tells :meth:`Speculator.draft` about one decoding sequence:
#: ``(key, context tokens, temperature, top_p, torch generator or None, largest k that fits)``.
DraftSlot = tuple[int, list[int], float, float, Any, int]

logger = logging.getLogger("edgecloud.speculative")


@dataclass
class Planned:
    """A draft to verify this step."""

    proposer: str
    proposal: Proposal


class Speculator:
    """Drafting and verification for the sequences of one scheduler (single-threaded: the scheduler's)."""

    def __init__(self, config: SpecConfig, proposers: dict[str, Proposer], *, metrics: ServerMetrics | None = None) -> None:
        usable = [n for n in ("draft", "ngram") if config.allows(n) and n in proposers]
        if config.mode != "off" and not usable:
            raise ConfigError(f"speculative mode {config.mode!r} needs a proposer; none was configured")
        self.config = config
        self.proposers = {n: proposers[n] for n in usable}
        self.metrics = metrics
        self.cost = StepCost()
        #: Seconds per drafted token, per proposer (measured).
        self.draft_cost: dict[str, float] = {n: 0.0 for n in self.proposers}
        #: Live acceptance per proposer across all sequences: seeds new sequences, picks for "auto".
        self.live = {n: Acceptance(config.prior_acceptance, decay=0.98) for n in self.proposers}
        self.states: dict[int, SpecState] = {}

    # ------------------------------------------------------------------ per sequence

    def admit(self, key: int, mode: str | None = None, k_max: int | None = None) -> SpecState | None:
        """Start speculating for sequence ``key`` (``mode``/``k_max``: the request's own limits, already checked)."""
        if mode == "off" or not self.proposers:
            return None
        names = tuple(n for n in self.proposers if mode in (None, "auto") or n == mode)
        if not names:
            return None
        state = SpecState(self.config, names, min(k_max or self.config.k_max, self.config.k_max))
        state.acceptance = {n: Acceptance(self.live[n].rate, decay=self.config.decay) for n in names}
        self.states[key] = state
        return state

    def release(self, key: int) -> SpecState | None:
        """Sequence ``key`` finished; its final state (for the usage block)."""
        for proposer in self.proposers.values():
            try:
                proposer.release(key)
            except Exception:  # noqa: BLE001 - a broken proposer must not break retirement
                logger.exception("proposer %s failed to release sequence %s", proposer.name, key)
        return self.states.pop(key, None)

    # ------------------------------------------------------------------ per step

    def _step_figures(self, rows: int) -> tuple[float, float]:
        a, b = self.cost.coefficients()
        if not self.cost.known:
            return 1.0, 0.05  # nothing measured yet: a nominal step where a row costs 5 %
        return a + b * rows, b

    def draft(self, sequences: list[DraftSlot], rows: int) -> dict[int, Planned]:
        """Drafts for a step of ``rows`` rows, for its decoding ``sequences``:
        ``(key, context tokens, temperature, top_p, generator, largest k that fits)``."""
        step, row = self._step_figures(rows)
        batch = len(sequences)
        wanted: dict[str, list[DraftRequest]] = {}
        caps = {key: cap for key, *_, cap in sequences}
        for key, tokens, temperature, top_p, generator, cap in sequences:
            state = self.states.get(key)
            if state is None:
                continue
            name, k = state.plan(step=step, row=row, draft_cost=self.draft_cost, batch=batch)
            k = min(k, cap)
            if k > 0:
                wanted.setdefault(name, []).append(DraftRequest(key, tokens, k, temperature, top_p, generator))
        planned: dict[int, Planned] = {}
        # the free proposer first: in "auto" a sequence the n-gram lookup has nothing for may still use the draft model
        for name in ("ngram", "draft"):
            requests = wanted.get(name)
            if not requests:
                continue
            proposals = self._propose(name, requests)
            for request, proposal in zip(requests, proposals):
                if proposal.tokens:
                    planned[request.key] = Planned(name, proposal)
                elif name == "ngram" and "draft" in self.proposers and "draft" in self.states[request.key].proposers:
                    # the k chosen for a free proposer is no k for a paid one: choose again for the draft model
                    k, gain = self.states[request.key].best_k("draft", step=step, row=row, draft_cost=self.draft_cost,
                                                                batch=batch)
                    if gain >= self.config.min_gain:
                        request.k = min(k, caps[request.key])
                        wanted.setdefault("draft", []).append(request)
        for key, *_ in sequences:
            state = self.states.get(key)
            if state is not None:
                plan = planned.get(key)
                state.k_trace.append(len(plan.proposal.tokens) if plan is not None else 0)
        if self.metrics is not None and sequences:
            self.metrics.set_spec_k(sum(len(p.proposal.tokens) for p in planned.values()) / len(sequences))
        return planned

    def _propose(self, name: str, requests: list[DraftRequest]) -> list[Proposal]:
        proposer = self.proposers[name]
        try:
            started = time.perf_counter()
            proposals = proposer.propose(requests)
            seconds = time.perf_counter() - started
            if proposer.last_seconds is not None:  # the proposer knows better (one-off prefills)
                seconds = proposer.last_seconds
        except Exception as exc:  # noqa: BLE001 - a draft failure never fails the request
            logger.warning("proposer %s failed, %d sequences continue without speculation: %s", name, len(requests), exc)
            for request in requests:
                state = self.states.get(request.key)
                if state is not None:
                    state.failures += 1
                    state.proposers = tuple(n for n in state.proposers if n != name)
                    if not state.proposers:
                        state.disabled_reason = f"{name} proposer failed: {exc}"
            if self.metrics is not None:
                self.metrics.on_draft_failure(name)
            return [Proposal() for _ in requests]
        drafted = sum(len(p.tokens) for p in proposals)
        if drafted:
            per_token = seconds / drafted
            old = self.draft_cost[name]
            self.draft_cost[name] = per_token if old == 0.0 else 0.8 * old + 0.2 * per_token
        return proposals

    def verify(self, key: int, planned: Planned, logits: torch.Tensor, *, temperature: float, top_p: float,
               generator: torch.Generator | None, rows: int, batch: int) -> Verdict:
        """Accept a prefix of ``planned``'s draft given the target's logits (``[k + 1, vocab]``, torch)."""
        from .verify import verify

        proposal = planned.proposal
        verdict = verify(logits, proposal.tokens, draft_probs=proposal.probs, temperature=temperature, top_p=top_p,
                         generator=generator)
        self.record(key, planned, verdict.accepted, rows=rows, batch=batch)
        return verdict

    def record(self, key: int, planned: Planned, accepted: int, *, rows: int, batch: int) -> None:
        """Book one verification of ``planned`` (``accepted`` drafts kept), however it was verified:
        the sequence's controller, the live acceptance and the metrics."""
        proposed = len(planned.proposal.tokens)
        step, row = self._step_figures(rows)
        state = self.states.get(key)
        if state is not None:
            state.record(planned.proposer, proposed, accepted, step=step, row=row, draft_cost=self.draft_cost,
                         batch=batch)
        self.live[planned.proposer].observe(proposed, accepted)
        if self.metrics is not None:
            self.metrics.on_draft(planned.proposer, proposed, accepted)

    def observe_step(self, rows: int, seconds: float, *, prefill: bool) -> None:
        """One forward's time (steps carrying a prompt chunk are a different regime and are left out)."""
        if not prefill:
            self.cost.observe(rows, seconds)

    def stats(self) -> dict[str, Any]:
        """Engine-wide figures: live acceptance, costs, the fitted step model."""
        a, b = self.cost.coefficients()
        return {
            "mode": self.config.mode,
            "live_acceptance": {n: round(acc.rate, 4) for n, acc in self.live.items()},
            "draft_seconds_per_token": {n: round(c, 6) for n, c in self.draft_cost.items()},
            "step_seconds": round(a, 6),
            "row_seconds": round(b, 6),
        }

    def close(self) -> None:
        """Close every proposer."""
        for proposer in self.proposers.values():
            proposer.close()
