"""Verified and checked mode: the edge drafts token ids, the cloud checks them in one forward pass per round.

This module owns :class:`DraftAndCheck`, one answer in which the device drafts and the cloud
verifies, and its two modes:

* ``verified`` - speculative decoding with the draft model on the device and the target behind
  an HTTP endpoint: every token is drafted in blocks of ``k`` and checked. The cloud scores
  the block in one request (:meth:`~edgecloud.remote.client.CloudBackend.score_in`:
  ``/v1/completions`` with ``echo`` and ``logprobs``); the longest prefix of the block the cloud
  would have written itself is kept, plus the cloud's own next token (its correction at the
  first disagreement, or one more token when it agreed with all of them). The answer is the
  cloud's greedy answer, token for token, at one cloud forward pass per round.
* ``checked`` - the edge writes while it is sure of its next token (its probability of its own
  greedy choice is at least ``trust``), streaming at once; at the first token it is unsure of,
  it drafts a block from there and the cloud checks the block as above. The cloud is called only
  where the edge hesitates, and each call keeps the cloud's choice exactly there. A call budget
  (``max_calls``) bounds the round trips of one answer: once spent, the edge writes alone.

**Pipelined rounds** (``collab.pipeline``, on by default in verified mode): while a check is in
flight the edge keeps drafting past the block as if it were accepted (its greedy line). When the
answer lands, what is consistent with it (the block kept and the cloud's next token equal to the
edge's next draft) stays drafted and the next check goes out at once; otherwise the edge drafts
again from the cloud's token. The first check carries the prompt alone and goes out before the
edge has read it (``collab.cloud_first_token``): the cloud's prefill runs while the edge prefills
and drafts, and the first token shown is the cloud's own greedy first token, so the answer
starts no later than the cloud's alone. Against a cloud that shares this process's CPUs
(``collab.overlap`` unset, :func:`shares_cpu`) the sides take turns instead: strict rounds,
opened by the prompt's check. The text is the same as with strict rounds (draft, then
wait for the check): only when each check is sent changes, never what is kept. A check that
fails while the edge is ahead leaves the edge to finish (``route.fallbacks``); a check whose
answer is no longer wanted (the caller stopped reading, the edge failed) is dropped.

**Where a block ends** in greedy plain answers when the sides take turns (strict rounds, and
pipelined ones against a cloud on this process's CPUs): after the first drafted token the edge
is less sure of than ``collab.draft_confidence`` (its probability of its own pick), else at
``draft_max``. The tokens after an unsure one are mostly rejected, and on the user's clock each
costs a draft step and a position the cloud computes, and an input token billed; the floor was
chosen replaying real answers held out by task family (``benchmarks/draft_stop.py``). While the edge drafts during
checks (pipelined rounds) drafting is off the user's clock and the block is the length the
measured costs favour: ending it at unsure tokens there added a third more checks for little
(one core each, RTT 50 ms: end to end 1.07x against 1.11x the slower side's, billed 0.78x against
0.80x). Where a block ends never changes the text, only the checks.

Each answer is a token session on the cloud (:class:`~edgecloud.remote.session.TokenSession`):
the first round sends the prompt, later rounds only the tokens the cloud has not seen, so the
cloud is paid for each token once. Each check asks the server to keep what it verified
(``session.keep_verified``): it holds the drafts it agrees with and its own token after them, as
its own generation would, so that token (the one output a round is billed for) is not sent back
as input; the next round sends only the new block. A server that lost the session gets the whole
context again (slower, same answer). ``k`` adapts per answer
(:class:`~edgecloud.runtime.speculative.Acceptance` and :func:`~edgecloud.runtime.speculative.best_k`
over the measured cost of a drafted token and of a round).

Needs an edge runtime that drafts token ids (:class:`~edgecloud.backend.Drafter`: the llama.cpp
backend) and edge and cloud models that share a tokenizer; anything else is a
:class:`~edgecloud.errors.ConfigError`. An endpoint that refuses to score (a hosted chat API) or
names other token ids is remembered in its capabilities; under ``collab="auto"`` an answer it
refused before showing anything is written by the next mode :mod:`.auto` ranks, one it refused
later goes on on the edge alone (a route note says which).

**Sampling** (``temperature`` above 0, as OpenAI's default of 1 when left out; ``top_p``,
``top_k``, ``min_p``, ``logit_bias``, ``seed``): both sides pick with the same noise
(:mod:`edgecloud.runtime.coupling`): per answer a seed, per position Gumbel noise from it; a
drafted token is kept where the cloud's own draw equals it. Each token is then the cloud's own
draw, so the answer is distributed exactly as the cloud's alone — and with a ``seed`` it is the
very text ``edgecloud serve`` writes alone (its sampler is the same scheme). A cloud that does
not draw with the shared noise (vLLM ignores the fields) refuses ``coupling``: under ``auto`` a
sampled answer moves to a mode where the cloud samples itself; never a silent greedy answer.
Presence and frequency penalties are not verified (each side would count another history).
A cloud that fails mid-answer leaves the edge to finish alone (``route.fallbacks`` says so); an
edge that fails hands the rest to the cloud.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlsplit

from ..answer import Part
from ..backend import Backend, Drafter, Verifier, close_stream
from ..errors import ConfigError, ContextOverflowError, ExtensionUnsupportedError, InvalidRequestError, VocabularyMismatchError
from ..fallback import Attempt
from ..observability.cost import forward_passes
from ..runtime.coupling import SCHEME, Picker
from ..runtime.hardware import cpu_budget
from ..runtime.held import HeldGrammar, HeldPicker
from ..runtime.scoring import Scored, TokenSession
from ..runtime.speculative import Acceptance, accept_prefix, best_k, expected_tokens
from ..runtime.text_stream import TextStream
from ..types import ChatCompletionChunk, FinishReason
from .auto import answer_coupling, may, unverifiable
from .run import AnswerRun, SharedAnswer, SharedMode, register_mode

__all__ = ["CheckedMode", "DraftAndCheck", "VerifiedMode", "can_score", "choose_k"]

T = TypeVar("T")

#: Acceptance assumed before the first round (a same-family draft agrees most of the time).
PRIOR_ACCEPTANCE = 0.7
#: Pipelined rounds: tokens the edge drafts from the cloud's token after a rejection before the
#: next check goes (the edge drafts on while it is out). One token checks at once but costs a
#: check (a pass, an output token billed) for ~2 tokens; 4 was faster, cheaper and used fewer
#: passes (benchmarks/pipeline.py, one core each, RTT 50 ms).
RESTART_BLOCK = 4
#: Text whose tokens the edge and the cloud must name alike before drafts are verified
#: (letters, digits, punctuation, spaces, a newline, a non-ASCII word).
VOCAB_PROBE = "Hello, world! def f(x):\n    return x * 42  # naïve café 東京"
#: (edge, cloud URL, cloud model) pairs whose vocabularies were found to agree.
_SAME_VOCAB: set[tuple[int, str, str]] = set()
#: (edge, cloud URL, cloud model, with tools) -> whether the two render a prompt to the same token ids.
_SAME_PROMPT: dict[tuple[int, str, str | None, bool], bool] = {}
#: Checks in flight while the edge drafts on (HTTP requests: threads that mostly wait).
_CHECKS = ThreadPoolExecutor(max_workers=32, thread_name_prefix="edgecloud-check")


def can_score(backend: Backend) -> bool:
    """Whether ``backend`` may check drafts: it scores continuations by token id
    (:class:`~edgecloud.backend.Verifier`) and has not refused to (a hosted chat API)."""
    return isinstance(backend, Verifier) and may(backend, "score") and may(backend, "token_ids")


class _StepDown(Exception):
    """The cloud refused what this mode needs before anything was shown: ``auto`` moves on."""

    def __init__(self, refused: ExtensionUnsupportedError, by: Attempt) -> None:
        super().__init__(str(refused))
        self.refused, self.by = refused, by


def choose_k(alpha: float, draft_s: float, round_s: float, k_max: int) -> int:
    """The draft length with the most expected tokens per second: ``E[tokens](alpha, k)`` over
    ``k`` draft tokens plus one cloud round."""
    return best_k(alpha, k_max, fixed=round_s, per_token=draft_s)[0]


class _EdgeFailed(Exception):
    """The edge runtime failed mid-answer (``error``): the cloud finishes the answer."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _on_edge(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    try:
        return call(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the edge's own failure, handed to the failover
        raise _EdgeFailed(exc) from exc


def _edge_stream(tokens: Iterator[tuple[int, float]]) -> Iterator[tuple[int, float]]:
    try:
        yield from tokens
    except Exception as exc:  # noqa: BLE001 - the edge's own failure, handed to the failover
        raise _EdgeFailed(exc) from exc


class _VocabRefused(Exception):
    """The vocabulary comparison before the first check refused the cloud (``error``)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class _Flight:
    """One check sent: ``block`` drafted after the context it was sent with, its answer to come."""

    attempt: Attempt
    block: list[int]
    future: Future[Scored]
    started: float
    #: Tokens of context before the block.
    at: int

    def drop(self) -> None:
        """Nobody will read this check's answer (it is dropped when it lands): its breaker trial is given back."""
        self.future.cancel()
        self.attempt.breaker.release()


class _RoundCost:
    """What one check costs on the user's clock as the line ``fixed + per_token * tokens``, fitted
    by decayed least squares over the checks of this answer (prior: ``fixed`` 0.1 s, 10 ms a token).
    A server computes a batch of drafted tokens at a cost that grows with the batch (on a CPU,
    almost as fast as decoding them one by one), so the block a check carries is chosen by it."""

    def __init__(self, decay: float = 0.85) -> None:
        self.decay = decay
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        for tokens in (2, 8):  # the prior, as two checks
            self.observe(tokens, 0.1 + 0.01 * tokens)

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self._n, self._x, self._y = d * self._n + 1, d * self._x + tokens, d * self._y + seconds
        self._xx, self._xy = d * self._xx + tokens * tokens, d * self._xy + tokens * seconds

    def line(self) -> tuple[float, float]:
        """``(fixed, per_token)`` seconds, neither below zero."""
        mean_x, mean_y = self._x / self._n, self._y / self._n
        var = self._xx / self._n - mean_x * mean_x
        slope = (self._xy / self._n - mean_x * mean_y) / var if var > 1e-9 else 0.0
        slope = max(0.0, slope)
        return max(0.0, mean_y - slope * mean_x), slope

    def block(self, alpha: float, k_min: int, k_max: int) -> int:
        """The block size with the most tokens per second of checks while the edge drafts during
        them; of those within 5 % of the best, the longest (fewer checks, fewer passes, at little
        cost to the user's clock)."""
        fixed, per_token = self.line()
        rates = {k: expected_tokens(alpha, k) / max(1e-6, fixed + (k + 1) * per_token) for k in range(k_min, k_max + 1)}
        best = max(rates.values())
        return max(k for k, rate in rates.items() if rate >= 0.95 * best)


def _loopback(url: str) -> bool:
    host = (urlsplit(url).hostname or "").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def shares_cpu(url: str) -> bool:
    """Whether a cloud at ``url`` computes on this process's CPUs: it is on this machine (a
    loopback address) and this process may use every CPU (not pinned to some of them, as an app
    and its server on separate cores are). Two llama.cpp processes computing at once on the same
    cores slow each other far more than twofold (their threads wait for each other at every
    operation), so pipelined rounds then keep the edge idle while a check is computed."""
    if not _loopback(url):
        return False
    budget = cpu_budget()
    return budget.allowed >= budget.logical


class _Line:
    """The edge's line after the written answer (``context``): ``tokens`` drafted ahead (greedy,
    or the picks of a picker from ``picker()``), one open stream on the edge while the line goes
    on unbroken."""

    def __init__(self, edge: Drafter, context: list[int], picker: Callable[[], Picker | None] = lambda: None) -> None:
        self.edge, self.context, self.picker = edge, list(context), picker
        self.tokens: list[int] = []
        self.ended = False  # the line reached an end-of-answer token
        self.seconds = 0.0
        self._stream: Iterator[tuple[int, float]] | None = None

    def extend(self, limit: int, stop: Callable[[], bool] = lambda: False) -> None:
        """Draft on until the line holds ``limit`` tokens, ends, or ``stop()`` says so."""
        started = time.perf_counter()
        while len(self.tokens) < limit and not self.ended and not stop():
            if self._stream is None:
                room = (self.edge.n_ctx or 0) - len(self.context) - len(self.tokens) - 1
                if room < 1:
                    self.ended = True
                    break
                self._stream = _edge_stream(self.edge.greedy(self.context + self.tokens, room, self.picker()))
            token = next(self._stream, None)
            if token is None:  # the stream reached the context's end
                self._stream = None
                self.ended = True
                break
            self.tokens.append(token[0])
            self.ended = self.edge.is_end(token[0])
        self.seconds += time.perf_counter() - started

    def advance(self, written: list[int]) -> bool:
        """``written`` joined the answer: the line goes on where it already holds them, else it is
        drafted again from the new context. Whether it went on."""
        self.context += written
        if self.tokens[:len(written)] == written:
            del self.tokens[:len(written)]
            return True
        self.close()
        self.tokens, self.ended = [], False
        return False

    def close(self) -> None:
        if self._stream is not None:
            close_stream(self._stream)
            self._stream = None


class DraftAndCheck(SharedAnswer):
    """One answer the edge drafts and the cloud checks (see the module docstring); ``trust`` None:
    every token is checked (verified mode)."""

    mode = "verified"
    trust: float | None = None
    #: Whether the edge only drafts (every token checked): then it drafts with ``run.drafter``,
    #: the faster file, where one is set. Checked mode keeps the edge's sure tokens unchecked.
    drafts_only: ClassVar[bool] = True

    def __init__(self, run: AnswerRun) -> None:
        super().__init__(run)
        if self.drafts_only and run.drafter is not None:
            self.edge_attempt = run.drafter()
            self.edge = self.edge_attempt.backend
        if not isinstance(self.edge, Drafter):
            raise ConfigError(f"collab={self.mode!r} needs an edge runtime that drafts token ids (llama.cpp); "
                              f"{self.edge.name} does not: use collab='token' or edge_runtime='llamacpp'")
        self.drafter: Drafter = self.edge
        for attempt in self.clouds:
            if not isinstance(attempt.backend, Verifier):
                raise ConfigError(f"collab={self.mode!r} needs a cloud client that scores continuations; "
                                  f"{attempt.backend.name} does not: use collab='token'")
        self.max_calls = run.settings.max_calls
        self.draft_min = run.settings.draft_min
        self.session = TokenSession()
        #: How the answer samples (None: greedy): both sides pick with the same noise.
        self.coupling = answer_coupling(self.request)
        #: The grammar the answer is held to (tool calls, json), and the edge's state of it at the
        #: written answer (drafts run ahead on forks of it); set when the answer starts.
        self.grammar: HeldGrammar | None = None
        self.held: HeldPicker | None = None
        self.text = ""
        self._stream = TextStream(self.request.stop_sequences)
        self.finish: FinishReason | None = None

    def chunks(self) -> Iterator[ChatCompletionChunk]:
        if self.request.continue_final_message:
            raise ConfigError(f"collab={self.mode!r} starts answers; to continue a partial answer use collab='token'")
        refused = unverifiable(self.request)
        if refused is not None:
            raise InvalidRequestError(f"collab={self.mode!r} cannot apply '{refused}' (the sides would pick with "
                                      f"different histories): leave it out, or use collab='token'", param=refused)
        pipelined = self.trust is None and self.settings.pipeline
        try:
            if pipelined and self._overlaps():
                yield from self._pipelined()
            else:  # strict rounds; pipelined ones with a cloud on this process's CPUs take turns the same way
                yield from self._answer(cloud_first=pipelined and self.settings.cloud_first_token)
        except _EdgeFailed as failed:  # the cloud writes the rest, through the one failover
            yield from self.cloud_finishes(failed.error)
        except _StepDown as down:  # nothing shown yet: the next mode writes the whole answer
            yield from self.run.step_down(down.refused, down.by)
        finally:
            if self.held is not None:
                self.held.close()

    def _start(self) -> tuple[list[int], int, Part, Part]:
        """The prompt's token ids, the answer's token budget, and the edge's and the cloud's parts."""
        messages, tools = self.request.message_dicts(), self.request.tool_dicts()
        prompt = self._clouds_prompt(messages, tools, _on_edge(self.drafter.tokenize_chat, messages, tools))
        self.recorder.prompt_tokens = len(prompt)
        self.grammar = HeldGrammar.of(self.request, len(prompt))
        if self.grammar is not None:
            self.held = _on_edge(self.drafter.hold, self.grammar, self.coupling)
        room = (self.edge.n_ctx or 0) - len(prompt) - 1
        if room < 1:  # the edge cannot hold the prompt (the router did not know its context yet)
            overflow = ContextOverflowError(len(prompt), self.edge.n_ctx or 0)
            raise _EdgeFailed(overflow) from overflow
        budget = min(self.request.max_tokens or room, room)
        return prompt, budget, self.recorder.part("edge", self.edge.name), self.recorder.part("cloud", "cloud")

    def _clouds_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       local: list[int]) -> list[int]:
        """The prompt's token ids as the cloud renders it (its chat template may differ from the
        edge's: two GGUF files of one family render tools differently). Asked of the first cloud
        once per edge, cloud and kind of prompt (with tools or without); where they agree the
        edge's own rendering is used from then on, where they differ the cloud is asked each
        answer (one round trip); a cloud that cannot say (no ``/tokenize``) gets the edge's."""
        attempt = self.clouds[0] if self.clouds else None
        if attempt is None or not isinstance(attempt.backend, Verifier) or not may(attempt.backend, "tokenize"):
            return local
        backend = attempt.backend
        key = (id(self.drafter), str(backend.base_url), backend.model_name, bool(tools))
        if _SAME_PROMPT.get(key):
            return local
        try:
            theirs = backend.tokenize_chat(messages, tools)
        except Exception:  # noqa: BLE001 - refused (remembered) or an outage: the checks will say
            return local
        _SAME_PROMPT[key] = theirs == local
        return theirs

    def _overlaps(self) -> bool:
        """Whether the edge drafts while a check is computed: ``collab.overlap``, else unless a cloud
        shares this process's CPUs (:func:`shares_cpu`)."""
        if self.settings.overlap is not None:
            return self.settings.overlap
        return not any(shares_cpu(str(a.backend.base_url)) for a in self.clouds)

    def _floor(self) -> float:
        """Where a block ends (``collab.draft_confidence``): in verified mode's greedy plain answers,
        where it was measured; checked mode's blocks start at an unsure token, and a sampled or
        grammar-held answer's picks are not its model's greedy choice (0: no floor)."""
        greedy = self.coupling is None or self.coupling.greedy
        return self.settings.draft_confidence if self.trust is None and greedy and self.grammar is None else 0.0

    def _answer(self, cloud_first: bool = False) -> Iterator[ChatCompletionChunk]:
        """Strict rounds: the edge drafts a block, then waits for its check. ``cloud_first``: the
        first check carries the prompt alone, before the edge reads it (the sides take turns on
        the CPUs and the first token shown is the cloud's)."""
        edge = self.drafter
        prompt, budget, edge_part, cloud_part = self._start()
        ids: list[int] = []
        acceptance = Acceptance(PRIOR_ACCEPTANCE)
        draft_s, round_s = 0.02, 0.1  # replaced by measurements after the first round
        floor = self._floor()
        k = self.settings.draft_max if floor > 0 else max(self.draft_min, min(self.settings.draft_max, 4))
        opening, measured = cloud_first, False
        while len(ids) < budget and self.finish is None:
            started = time.perf_counter()
            block: list[int] = []
            if opening:  # the prompt's check: nothing drafted yet
                opening = False
            else:
                if self.trust is not None:  # the edge writes on while it is sure
                    yield from self._sure_run(prompt, ids, budget, edge_part, block)
                    if self.finish is not None or len(ids) >= budget or not block:
                        break
                k = max(1, min(k, budget - len(ids)))
                if len(block) < k and not (block and edge.is_end(block[-1])):
                    block += _on_edge(edge.draft, prompt + ids + block, k - len(block), self._picker(),
                                      until_below=floor, at_least=max(1, self.draft_min - len(block)))
            edge_s = time.perf_counter() - started
            edge_part.seconds += edge_s
            attempt = self.cloud_attempt() if self._calls_left() else None
            kept, extra = block, None  # no cloud to check with: the edge writes alone
            if attempt is not None:
                checked = self._settle(self._send(attempt, prompt + ids, block, cloud_part, wait=True), cloud_part)
                self._holds_sessions(attempt)
                if checked is not None:
                    kept, extra = checked
                    acceptance.observe(len(block), len(kept))
                    if block and (measured or not cloud_first):  # (the first drafts read the prompt too)
                        draft_s = 0.7 * draft_s + 0.3 * edge_s / len(block)
                    measured = measured or bool(block)
                    round_s = 0.7 * round_s + 0.3 * (time.perf_counter() - started - edge_s)
            written = [*(("edge", t) for t in kept), *((("cloud", extra),) if extra is not None else ())]
            for side, token in written:
                yield from self._write(side, token, ids, edge_part if side == "edge" else cloud_part, budget)  # type: ignore[arg-type]
                if self.finish is not None or len(ids) >= budget:
                    break
            if not floor:  # (with a floor the block ends where the edge is unsure, up to draft_max)
                k = max(self.draft_min, choose_k(acceptance.rate, draft_s, round_s, self.settings.draft_max))
        yield from self.emit("edge", self._stream.flush())
        self._rounds_done("rounds")
        yield from self.final(self.finish or "length")

    def _pipelined(self) -> Iterator[ChatCompletionChunk]:
        """Verified mode with the edge drafting while each check is in flight (see the module
        docstring): one check out at a time, the next sent as soon as the last one lands."""
        prompt, budget, edge_part, cloud_part = self._start()
        ids: list[int] = []
        acceptance, cost = Acceptance(PRIOR_ACCEPTANCE), _RoundCost()
        k_max = self.settings.draft_max
        line = _Line(self.drafter, prompt, self._picker)
        flight: _Flight | None = None
        first = self.settings.cloud_first_token and budget > 0
        try:
            while len(ids) < budget and self.finish is None:
                if flight is None:
                    left = budget - len(ids)
                    # what the edge drafted while the last check was out goes at once (up to the
                    # block size the measured costs favour); after a rejection, the first
                    # RESTART_BLOCK tokens go and the edge drafts on while they are checked
                    line.extend(0 if first else min(left, max(self.draft_min, RESTART_BLOCK)))
                    block = line.tokens[:min(left, cost.block(acceptance.rate, self.draft_min, k_max))]
                    attempt = self.cloud_attempt() if self._calls_left() else None
                    if attempt is None:  # no cloud to check with: the edge writes its block alone
                        if not block:
                            line.extend(1)
                            block = line.tokens[:1]
                        for token in block:
                            yield from self._write("edge", token, ids, edge_part, budget)
                            if self.finish is not None or len(ids) >= budget:
                                break
                        line.advance(block)
                        first = False
                        continue
                    flight = self._send(attempt, prompt + ids, block, cloud_part)
                    first = False
                # a check is in flight: draft past its block until it lands
                line.extend(min(budget - len(ids), len(flight.block) + 1 + k_max), flight.future.done)
                outcome = self._settle(flight, cloud_part)
                landed, flight = flight, None
                self._holds_sessions(landed.attempt)
                if outcome is None:  # failed or refused: the edge's block stands
                    kept, extra = landed.block, None
                else:
                    kept, extra = outcome
                    if landed.block:  # (the prompt's check costs its prefill: not a round's cost)
                        acceptance.observe(len(landed.block), len(kept))
                        cost.observe(len(landed.block) + 1, time.perf_counter() - landed.started)
                written = [*kept, *([extra] if extra is not None else [])]
                for i, token in enumerate(written):
                    side = "cloud" if extra is not None and i == len(kept) else "edge"
                    yield from self._write(side, token, ids, edge_part if side == "edge" else cloud_part, budget)
                    if self.finish is not None or len(ids) >= budget:
                        break
                line.advance(written)
        finally:
            line.close()
            if flight is not None:
                flight.drop()
            edge_part.seconds += line.seconds
        yield from self.emit("edge", self._stream.flush())
        self._rounds_done("pipelined rounds")
        yield from self.final(self.finish or "length")

    def _picker(self) -> Picker | None:
        """What the edge drafts with from the written answer on: None (greedy), the coupling, or a
        fork of the answer's grammar state (drafts run ahead on it)."""
        return self.held.fork() if self.held is not None else self.coupling

    def _rounds_done(self, kind: str) -> None:
        """The route notes of a finished answer: how it sampled, and in how many rounds."""
        c = self.coupling
        if c is not None and not c.greedy:
            self.recorder.note("sampling", f"sampled with shared noise ({SCHEME}; temperature {c.temperature:g}, "
                                           f"top_p {c.top_p:g}{f', top_k {c.top_k}' if c.top_k > 0 else ''}"
                                           f"{f', min_p {c.min_p:g}' if c.min_p else ''}): every token is the "
                                           "cloud's own draw", c.temperature)
        calls = self.recorder.cloud_calls
        self.recorder.note("verified_rounds", f"checked by the cloud in {calls} {kind}", calls)

    def _refused(self, attempt: Attempt, refused: ExtensionUnsupportedError) -> None:
        """The endpoint refused to check (it cannot score, or names other token ids). Under
        ``collab="auto"`` the answer moves to the next mode ``auto`` ranks when nothing was shown
        yet (the endpoint's capabilities remember it for later answers), else this answer goes
        on on the edge; asked for by name, the refusal is raised."""
        attempt.breaker.release()
        if not self.run.auto:
            raise refused
        if not self._opened:
            raise _StepDown(refused, attempt) from refused
        self.clouds = [a for a in self.clouds if a is not attempt]
        self.recorder.note("collab_mode", f"{attempt.label or attempt.backend.name} refused "
                                          f"{refused.extension!r}: the edge writes on alone")

    def _holds_sessions(self, attempt: Attempt) -> None:
        """Under ``collab="auto"``, before anything was shown: a cloud that answered the first check
        without holding the session would be sent the whole context at every later check (vLLM; many
        times the bill of asking it alone), so the answer steps down to the next mode."""
        if self.run.auto and not self._opened and self.session.supported is False:
            said = (f"{attempt.label or attempt.backend.name} holds no token session: every check would send the "
                    "whole context again")
            raise _StepDown(ExtensionUnsupportedError(said, extension="sessions"), attempt)

    def _calls_left(self) -> bool:
        return self.max_calls is None or self.recorder.cloud_calls < self.max_calls

    def _sure_run(self, prompt: list[int], ids: list[int], budget: int, part: Part,
                  block: list[int]) -> Iterator[ChatCompletionChunk]:
        """Stream the edge's tokens while it is sure of each (or nothing is left to check with);
        the first it is unsure of goes into ``block`` (to be drafted on from and checked)."""
        assert self.trust is not None
        edge = self.drafter
        tokens = _edge_stream(edge.greedy(prompt + ids, budget - len(ids), self._picker()))
        try:
            for token, p in tokens:
                if p < self.trust and self._calls_left() and any(a.breaker.available() for a in self.clouds):
                    block.append(token)
                    return
                yield from self._write("edge", token, ids, part, budget)
                if self.finish is not None:
                    return
        finally:
            close_stream(tokens)

    def _write(self, side: str, token: int, ids: list[int], part: Part, budget: int
               ) -> Iterator[ChatCompletionChunk]:
        """One answer token, written by ``side``: to the caller unless it ends the answer."""
        ids.append(token)
        edge = self.drafter
        if edge.is_end(token):
            self.finish = "stop"
            return
        if self.held is not None:  # the written answer's grammar state moves on
            if self.held.mask.allows(token):
                self.held.accept(token)
            else:  # (cannot happen with one grammar on both sides: the edge then drafts unheld, the cloud still checks)
                self.held.close()
                self.held = None
        self.recorder.wrote(side, 1)  # type: ignore[arg-type]
        if side == "edge":
            part.completion_tokens += 1  # the cloud's part counts the tokens it was billed for (one a round)
        backend = self.edge.name if side == "edge" else part.backend
        yield from self.emit(side, self._stream.push(edge.token_bytes(token)), backend=backend)
        if self._stream.stopped:
            self.finish = "stop"

    def _vocabulary_check(self, attempt: Attempt) -> Callable[[], None] | None:
        """What compares the edge's and the cloud's names for the probe's tokens before the first
        check to this cloud (None: known alike, or not a verifier); it raises
        :class:`~edgecloud.errors.VocabularyMismatchError` when they differ (checked once per pair)."""
        edge, backend = self.drafter, attempt.backend
        key = (id(edge), str(backend.base_url), backend.model_name)
        if key in _SAME_VOCAB or not isinstance(backend, Verifier):
            return None
        tokens = edge.tokenize_text(VOCAB_PROBE)
        if not tokens:
            return None
        mine = [edge.token_bytes(t).decode("utf-8", errors="replace") for t in tokens]

        def compare() -> None:
            try:
                theirs = backend.token_texts(tokens)
            except ConfigError:
                raise
            except Exception:  # noqa: BLE001 - an outage, not a mismatch: the check itself reports it
                return
            # ASCII pieces read the same through any server's detokenizer (vLLM names partial
            # UTF-8 pieces its own way): those are compared
            if len(theirs) != len(mine) or any(a != b for a, b in zip(mine, theirs) if a.isascii()):
                said = (f"collab={self.mode!r} needs edge and cloud models with one tokenizer; {edge.model_name} and "
                        f"{backend.model_name} split text differently ({mine[:4]} vs {theirs[:4]}): use collab='token'")
                if backend.capabilities is not None:
                    backend.capabilities.refuse("token_ids", said)
                raise VocabularyMismatchError(said)
            _SAME_VOCAB.add(key)

        return compare

    def _send(self, attempt: Attempt, tokens: list[int], draft: list[int], part: Part, *, wait: bool = False) -> _Flight:
        """Send the check of ``draft`` after ``tokens`` to ``attempt``'s cloud (in the session: only
        what it does not hold); ``wait``: answered before this returns, else it lands while the
        edge drafts on."""
        part.backend = attempt.backend.name
        verifier = attempt.backend
        assert isinstance(verifier, Verifier)  # checked when the answer started
        compare = self._vocabulary_check(attempt)
        context = tokens + draft

        def check() -> Scored:
            if compare is not None:
                try:
                    compare()
                except Exception as exc:  # noqa: BLE001 - told apart from the check's own failure
                    raise _VocabRefused(exc) from exc
            return verifier.score_in(self.session, context, start=len(tokens), top_n=1, coupling=self.coupling,
                                     grammar=self.grammar, keep_verified=True)

        started = time.perf_counter()
        if wait:
            future: Future[Scored] = Future()
            try:
                future.set_result(check())
            except Exception as exc:  # noqa: BLE001 - read back by _settle
                future.set_exception(exc)
        else:
            future = _CHECKS.submit(check)
        return _Flight(attempt, list(draft), future, started, len(tokens))

    def _settle(self, flight: _Flight, part: Part) -> tuple[list[int], int] | None:
        """The kept draft prefix and the cloud's next token, once the check has landed; None when
        the cloud failed (recorded: the edge writes on alone) or refused (see :meth:`_refused`)."""
        attempt = flight.attempt
        try:
            scored = flight.future.result()
        except _VocabRefused as refused:
            attempt.breaker.release()
            if isinstance(refused.error, ExtensionUnsupportedError):
                self._refused(attempt, refused.error)
                return None
            raise refused.error from None
        except ExtensionUnsupportedError as refused:  # not a failed check: the endpoint cannot check
            self._counted(part)
            self._refused(attempt, refused)
            return None
        except Exception as exc:  # noqa: BLE001 - classified: a configuration mistake is raised
            self._counted(part)
            self.cloud_failed(attempt, exc, "verification")
            self.span_done("failed", 0, time.perf_counter() - flight.started)
            self.clouds = [a for a in self.clouds if a is not attempt]  # the edge (or the next URL) finishes
            return None
        self._counted(part)
        attempt.breaker.success()
        part.prompt_tokens += scored.sent
        part.cached_tokens += scored.cached
        part.completion_tokens += 1  # the round's next token, generated and billed
        part.passes += forward_passes(scored.sent - scored.cached, 1)
        part.seconds += time.perf_counter() - flight.started
        scores, nxt, draft = scored.scores, scored.next, flight.block
        kept = accept_prefix(draft, [s.choice for s in scores])  # the cloud's greedy choice, or its coupled draw
        extra = scores[kept].choice if kept < len(draft) else nxt.token
        self.session.checked(flight.at, kept, extra, scored)  # the rejected drafts are not context
        self.span_done("verified", 1, time.perf_counter() - flight.started)
        return draft[:kept], extra

    def _counted(self, part: Part) -> None:
        self.recorder.cloud_call()
        part.calls += 1


class CheckedAnswer(DraftAndCheck):
    """One answer in checked mode: the edge writes while sure, the cloud checks where it is not."""

    mode = "checked"
    drafts_only = False

    def __init__(self, run: AnswerRun) -> None:
        super().__init__(run)
        self.trust = run.settings.trust


@register_mode
class VerifiedMode(SharedMode):
    """Verified mode: every token checked (see the module docstring)."""

    name = "verified"
    can_redact = False
    describe = "the edge drafts, the cloud verifies every draft (its own answer, token for token)"
    answer = DraftAndCheck


@register_mode
class CheckedMode(SharedMode):
    """Checked mode: the cloud checks where the edge is unsure (see the module docstring)."""

    name = "checked"
    can_redact = False
    describe = "the edge writes, the cloud checks the tokens the edge is unsure of"
    answer = CheckedAnswer
