"""Speculative decoding on the device: drafts verified by the edge model in one batched pass.

This module owns :class:`EdgeSpeculator` (one per :class:`~edgecloud.edge.llamacpp.LlamaCppBackend`
or :class:`~edgecloud.edge.torch.TorchBackend`), :func:`parse_edge_speculate` (the
``edge_speculate`` setting) and :func:`remembered_probe` (each runtime's answer to how many rows
one pass evaluates exactly, kept on disk). An edge answer is decoded one
token per sweep of the weights through memory; when the next tokens can be guessed cheaply, the
model checks a guess of ``k`` tokens in one pass (``k + 1`` rows cost little more than one on a
memory-bound CPU) and keeps the longest prefix it would have written itself, plus its own next
token.

Where guesses come from (``edge_speculate``):

- ``"auto"`` (the default) and ``"ngram"``: prompt lookup (:class:`~edgecloud.runtime.spec_proposers.NgramProposer`),
  free, strong when the answer copies from its prompt (edit this function, fix this line, answer
  from this document, fill this JSON), silent otherwise;
- a catalogue name or ``.gguf`` path: a smaller draft model of the same family (same vocabulary,
  checked at load), greedy, with prompt lookup beside it; the controller uses whichever has
  been accepted more;
- ``"off"``: plain decoding.

How much to guess is the serving engines' controller (:mod:`edgecloud.runtime.spec_control`, one
implementation): ``k`` from the live acceptance and a fitted cost of a pass of ``rows`` rows,
switched off when no ``k`` pays, re-probed now and then. Verification samples each position with
the request's own sampler (argmax when greedy, the llama.cpp chain otherwise, grammars
included) and stops at the first token that differs from the guess: drafts are deterministic,
so this is exact — greedy text is the model's own greedy text, sampled text follows the model's
distribution, and the sampler sees exactly the tokens that are emitted, in order. Nothing
downstream (logprobs, stop strings, tool-call parsing, the collaboration gate) ever sees a
draft before it is verified.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..errors import ConfigError
from ..runtime.spec_control import Acceptance, SpecConfig, SpecState, StepCost
from ..runtime.spec_proposers import NgramProposer

__all__ = ["PROBE_FILLER", "PROBE_LONG_CONTEXT", "PROBE_TEXT", "EdgeSpeculator", "Probe", "parse_edge_speculate", "remembered_probe", "spec_usage"]

_log = logging.getLogger("edgecloud.edge")

#: Most tokens guessed at once on the device.
EDGE_K_MAX = 8
#: Context length at which a runtime's probe checks again that a pass of several rows rounds like
#: single steps (attention over a longer context can round differently where a short one did not).
PROBE_LONG_CONTEXT = 320
#: What a probe evaluates one row at a time and then in one pass (repeated to the rows asked for).
PROBE_TEXT = "def total(values):\n    return sum(v for v in values if v > 0)\n"
#: What fills the context up to :data:`PROBE_LONG_CONTEXT` before the second probe (repeated).
PROBE_FILLER = "for item in range(10):\n    print(item, item * item)\n"

#: A probe's answer: the most rows one pass evaluates exactly, and ``(rows, seconds)`` of the passes timed.
Probe = tuple[int, list[tuple[int, float]]]


def parse_edge_speculate(value: str | None) -> tuple[str, str | None]:
    """``(mode, draft_model)`` for an ``edge_speculate`` value: ``("off", None)``, ``("ngram", None)``
    (also what ``"auto"`` and None mean), or ``("auto", model)`` for a draft model's name or path."""
    text = "auto" if value is None else str(value).strip()
    if not text:
        raise ConfigError("edge_speculate is empty; use auto, off, ngram, or a draft model's catalogue name or .gguf path")
    if text in ("auto", "ngram"):
        return "ngram", None
    if text == "off":
        return "off", None
    return "auto", text


class DraftModel(Protocol):
    """A loaded draft model: its greedy continuation of a token list."""

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """The next ``k`` greedy tokens after ``tokens``."""

    def close(self) -> None:
        """Free it."""


class EdgeSpeculator:
    """Drafts and the k controller for one edge runtime (its requests run one at a time).

    ``fixed_k`` skips the controller and the exactness limit: every step guesses that many tokens
    (where a guess is found), even where a pass of several rows rounds differently from one row
    (greedy text may then differ at near-ties); for experiments and tests.

    ``draft_model`` (a catalogue name or path) is loaded on first use by ``make_draft`` (the
    runtime's: a second llama.cpp runtime with the target's context, its vocabulary checked).
    """

    def __init__(self, *, draft_model: str | None = None, make_draft: Callable[[str], DraftModel] | None = None,
                 k_max: int = EDGE_K_MAX, fixed_k: int | None = None) -> None:
        if draft_model is not None and make_draft is None:
            raise ConfigError("a draft model needs make_draft (how the runtime loads it)")
        if fixed_k is not None and not 1 <= fixed_k <= k_max:
            raise ConfigError(f"a fixed number of guessed tokens must be in 1..{k_max}, got {fixed_k}")
        # fixed_k: always guess that many, exact or not, as vLLM's num_speculative_tokens
        self.config = SpecConfig(mode="auto" if draft_model else "ngram", k_max=fixed_k or k_max,
                                 adaptive=fixed_k is None)
        self.draft_model = draft_model
        self.proposers: tuple[str, ...] = ("draft", "ngram") if draft_model else ("ngram",)
        self.ngram = NgramProposer()
        #: The target's pass time, ``a + b * rows`` (decode steps and verifications).
        self.cost = StepCost()
        #: Seconds per drafted token, per proposer (prompt lookup: free).
        self.draft_cost: dict[str, float] = {"ngram": 0.0, "draft": 0.0}
        self._make_draft = make_draft
        self._draft: DraftModel | None = None
        #: Most tokens one guess may hold (see :meth:`calibrate`).
        self.k_limit = self.config.k_max
        #: Why speculation is off on this machine, or None.
        self.disabled: str | None = None

    def state(self) -> SpecState:
        """A fresh controller state for one answer."""
        return SpecState(self.config, self.proposers, max(1, self.k_limit),
                         acceptance={p: Acceptance(self.config.prior_acceptance, decay=self.config.decay)
                                     for p in self.proposers})

    def _costs(self) -> tuple[float, float]:
        a, b = self.cost.coefficients()
        return a + b, b

    def propose(self, state: SpecState, tokens: list[int], cap: int) -> tuple[str, list[int]]:
        """The proposer and its guess (at most ``cap`` tokens) after ``tokens``; ``("", [])``: decode plainly."""
        if cap < 1 or not self.cost.known or self.disabled is not None:
            return "", []
        step, row = self._costs()
        name, k = state.plan(step=step, row=row, draft_cost=self.draft_cost, batch=1)
        k = min(k, cap)
        if k < 1:
            return "", []
        if name == "draft":
            drafts = self._draft_tokens(tokens, k)
            if drafts:
                return name, drafts
            name = "ngram"  # the draft model failed or had nothing: the free proposer instead
        return name, self.ngram.lookup(tokens, k)

    def calibrate(self, probe: Callable[[int], tuple[int, list[tuple[int, float]]]]) -> None:
        """Learn, once per load, how many rows one pass may verify exactly and what passes cost.

        ``probe(limit)`` (the runtime's) answers the most rows, up to ``limit``, whose logits are
        bitwise those of one-at-a-time decoding, and ``(rows, seconds)`` of the passes it timed.
        Guesses are capped one below that, so greedy text stays the model's own token for token;
        where no batch is exact, speculation is off (said in :attr:`disabled`)."""
        exact, timed = probe(self.config.k_max + 1)
        for rows, seconds in timed:
            self.cost.observe(rows, seconds)
        if not self.config.adaptive:  # a fixed k is the caller's choice, exact or not
            self.k_limit, self.disabled = self.config.k_max, None
            return
        self.k_limit = min(self.config.k_max, exact - 1)
        self.disabled = None if self.k_limit >= 1 else (
            "no batch of rows decodes exactly as one row does on this device: guesses would change greedy text")
        if self.disabled:
            _log.info("edge speculation off: %s", self.disabled)
        else:
            _log.debug("edge speculation: up to %d guessed tokens per pass (%d rows decode exactly)", self.k_limit, exact)

    def prepare(self) -> None:
        """Load the draft model now (the runtime calls this once its own model is loaded), so a
        draft that cannot serve this target (another vocabulary) is an error at load, not mid-answer."""
        if self.draft_model is not None and self._draft is None:
            assert self._make_draft is not None
            self._draft = self._make_draft(self.draft_model)

    def _draft_tokens(self, tokens: list[int], k: int) -> list[int]:
        try:
            self.prepare()
            assert self._draft is not None
            started = time.perf_counter()
            out = self._draft.draft(tokens, k)
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001 - a draft failure drops drafting, never the answer
            self.proposers = ("ngram",)
            self.draft_cost.pop("draft", None)
            return []
        if out:
            per_token = (time.perf_counter() - started) / len(out)
            previous = self.draft_cost.get("draft", 0.0)
            self.draft_cost["draft"] = per_token if previous == 0 else 0.8 * previous + 0.2 * per_token
        return out

    def observe(self, rows: int, seconds: float) -> None:
        """A pass of the target over ``rows`` rows took ``seconds``."""
        self.cost.observe(rows, seconds)

    def record(self, state: SpecState, proposer: str, proposed: int, accepted: int) -> None:
        """The outcome of one verification."""
        step, row = self._costs()
        state.k_trace.append(proposed)
        state.record(proposer, proposed, accepted, step=step, row=row, draft_cost=self.draft_cost, batch=1)

    def close(self) -> None:
        """Free the draft model, if one was loaded."""
        if self._draft is not None:
            self._draft.close()
            self._draft = None


def remembered_probe(key: str, measure: Callable[[], Probe]) -> Probe:
    """``measure()``'s answer, kept in ``edge-speculation.json`` under the edgecloud home by
    ``key`` (model, runtime, threads, device: what the answer depends on), so it is measured once
    per machine; an unreadable record is measured again, an unwritable one is not kept."""
    from ..store.cache import home_dir

    record = home_dir() / "edge-speculation.json"
    try:
        known = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), dict):
        entry = known[key]
        with contextlib.suppress(KeyError, TypeError, ValueError):
            return int(entry["exact"]), [(int(r), float(s)) for r, s in entry["timed"]]
    exact, timed = measure()
    if isinstance(known, dict):
        known[key] = {"exact": exact, "timed": timed}
        with contextlib.suppress(OSError):
            record.parent.mkdir(parents=True, exist_ok=True)
            tmp = record.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known), encoding="utf-8")
            os.replace(tmp, record)
    return exact, timed


def spec_usage(state: SpecState | None) -> dict[str, Any] | None:
    """The ``speculative`` block of an answer's usage (None when nothing was drafted)."""
    return state.summary() if state is not None and state.drafts else None
