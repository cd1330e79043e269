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
again from the cloud's token. With ``collab.checks_in_flight`` 2 the next check does not wait for
that answer: once the edge has drafted a block past the one out, it goes too, on the bet that the
one out is kept whole and the cloud's token after it is the edge's next draft (taken where the
edge's own odds of that are at least ``BET_ODDS``; it
carries that token, so it is scored again: a check sent ahead reads nothing of an answer it did
not see). The server checks one answer's requests in arrival order (``edgecloud serve``); a bet
that did not hold is dropped (the server refuses it, 409, where the check before kept less, and
what it computed otherwise is billed), and one that held is read as the next check, so the round
trip and the server's idle time between checks leave the user's clock. On a CPU cloud that did not
pay (the server computes between checks anyway; lost bets and the token each bet carries cost it
work), so one check is out at a time by default. The cloud opens the answer before the edge has
read the prompt (``collab.cloud_first_token``): its prefill runs while the edge prefills and
drafts, and the first token shown is the cloud's own greedy first token, so the answer starts no
later than the cloud's alone. A cloud that streams token ids (``stream_ids``: ``edgecloud
serve``, vLLM; :mod:`edgecloud.remote.opening`) and was seen to hold token sessions streams the
answer's first ``collab.stream_opening`` tokens in that one request, at its own pace, while the
edge drafts past them: an answer that short is the cloud's alone, with no round trip a token; the
checks start after them. Elsewhere the first check carries the prompt alone. Against a cloud that
shares this process's CPUs (``collab.overlap`` unset, :func:`shares_cpu`) the sides take turns
instead: strict rounds, opened by the cloud: its first ``collab.opening_tokens`` tokens, streamed
the same way (or the prompt's check and a check without drafts a token), before the edge reads
the prompt. There the edge's read and its first round cost ~0.2 s the cloud alone would not
spend, so an answer that short ends at the cloud's own pace, and a longer one pays a pass a token
opened. The text is the same as with
strict rounds (draft, then wait for the check): only when each check is sent changes, never what
is kept. A check that
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

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar

from ..answer import Part
from ..backend import Backend, Drafter, Opener, Verifier, close_stream
from ..errors import (ConfigError, ContextOverflowError, ExtensionUnsupportedError, InvalidRequestError,
                      SessionExpiredError, VocabularyMismatchError)
from ..fallback import Attempt
from ..observability.cost import forward_passes
from ..runtime.coupling import SCHEME, Picker
from ..runtime.held import HeldGrammar, HeldPicker
from ..runtime.scoring import Scored, TokenSession
from ..runtime.speculative import Acceptance, accept_prefix, best_k
from ..runtime.text_stream import TextStream
from ..types import ChatCompletionChunk, FinishReason
from .auto import answer_coupling, may, unverifiable
from .rounds import DraftLine, EdgeFailed, Flight, Opening, RoundCost, edge_stream, on_edge, shares_cpu
from .run import AnswerRun, SharedAnswer, SharedMode, register_mode

__all__ = ["CheckedMode", "DraftAndCheck", "VerifiedMode", "can_score", "choose_k"]

#: Acceptance assumed before the first round (a same-family draft agrees most of the time).
PRIOR_ACCEPTANCE = 0.7
#: Pipelined rounds: tokens the edge drafts from the cloud's token after a rejection before the
#: next check goes (the edge drafts on while it is out). One token checks at once but costs a
#: check (a pass, an output token billed) for ~2 tokens; 4 was faster, cheaper and used fewer
#: passes (benchmarks/pipeline.py, one core each, RTT 50 ms).
RESTART_BLOCK = 4
#: Pipelined rounds with two checks in flight: the next check goes before the one out lands only
#: where the edge's own odds that the one out is kept whole and followed by its next draft (the
#: product of its probabilities of those picks) are at least this; a lost bet costs the cloud.
BET_ODDS = 0.5
#: Text whose tokens the edge and the cloud must name alike before drafts are verified
#: (letters, digits, punctuation, spaces, a newline, a non-ASCII word).
VOCAB_PROBE = "Hello, world! def f(x):\n    return x * 42  # naïve café 東京"
#: (edge, cloud URL, cloud model) pairs whose vocabularies were found to agree.
_SAME_VOCAB: set[tuple[int, str, str]] = set()
#: (edge, cloud URL, cloud model, with tools) -> whether the two render a prompt to the same token ids.
_SAME_PROMPT: dict[tuple[int, str, str | None, bool], bool] = {}
#: (cloud URL, backend name) of clouds that refused a check sent ahead whose bet held: they do not
#: check one session's requests in arrival order, so no more are sent them.
_UNORDERED: set[tuple[str, str]] = set()
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


class _BetRefused(Exception):
    """A check sent ahead, whose bet held, was refused by the server (it held fewer tokens)."""


def _endpoint(attempt: Attempt) -> tuple[str, str]:
    """Which cloud an attempt asks: its URL and its backend's name."""
    return str(attempt.backend.base_url), attempt.backend.name


class _VocabRefused(Exception):
    """The vocabulary comparison before the first check refused the cloud (``error``)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


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
        #: Checks sent ahead of the one out, and those whose bet held (pipelined rounds).
        self._bets_sent = self._bets_held = 0

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
        except EdgeFailed as failed:  # the cloud writes the rest, through the one failover
            yield from self.cloud_finishes(failed.error)
        except _StepDown as down:  # nothing shown yet: the next mode writes the whole answer
            yield from self.run.step_down(down.refused, down.by)
        finally:
            if self.held is not None:
                self.held.close()

    def _start(self) -> tuple[list[int], int, Part, Part]:
        """The prompt's token ids, the answer's token budget, and the edge's and the cloud's parts."""
        messages, tools = self.request.message_dicts(), self.request.tool_dicts()
        prompt = self._clouds_prompt(messages, tools, on_edge(self.drafter.tokenize_chat, messages, tools))
        self.recorder.prompt_tokens = len(prompt)
        self.grammar = HeldGrammar.of(self.request, len(prompt))
        if self.grammar is not None:
            self.held = on_edge(self.drafter.hold, self.grammar, self.coupling)
        room = (self.edge.n_ctx or 0) - len(prompt) - 1
        if room < 1:  # the edge cannot hold the prompt (the router did not know its context yet)
            overflow = ContextOverflowError(len(prompt), self.edge.n_ctx or 0)
            raise EdgeFailed(overflow) from overflow
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
        cloud opens the answer before the edge reads the prompt, the prompt's check and then a
        check without drafts a token, ``collab.opening_tokens`` in all (the sides take turns on
        the CPUs; the first token shown is the cloud's, and a short answer is the cloud's alone)."""
        edge = self.drafter
        prompt, budget, edge_part, cloud_part = self._start()
        ids: list[int] = []
        acceptance = Acceptance(PRIOR_ACCEPTANCE)
        draft_s, round_s = 0.02, 0.1  # replaced by measurements after the first round
        floor = self._floor()
        k = self.settings.draft_max if floor > 0 else max(self.draft_min, min(self.settings.draft_max, 4))
        opening, measured = self.settings.opening_tokens if cloud_first else 0, False
        if cloud_first and (yield from self._stream_opening(prompt, budget, opening, None, ids, cloud_part)):
            opening = 0  # (the cloud streamed it; else a check without drafts for each token, below)
        while len(ids) < budget and self.finish is None:
            started = time.perf_counter()
            block: list[int] = []
            if len(ids) >= opening:  # (before: the cloud opens the answer, checks without drafts)
                if self.trust is not None:  # the edge writes on while it is sure
                    yield from self._sure_run(prompt, ids, budget, edge_part, block)
                    if self.finish is not None or len(ids) >= budget or not block:
                        break
                k = max(1, min(k, budget - len(ids)))
                if len(block) < k and not (block and edge.is_end(block[-1])):
                    block += on_edge(edge.draft, prompt + ids + block, k - len(block), self._picker(),
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
            if not written:  # the cloud did not answer a check without drafts: the edge drafts from here
                opening = 0
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
        docstring): the next check goes as soon as the last one lands, or, with
        ``collab.checks_in_flight`` 2, at once on the bet that the one out is kept whole."""
        prompt, budget, edge_part, cloud_part = self._start()
        ids: list[int] = []
        acceptance, cost = Acceptance(PRIOR_ACCEPTANCE), RoundCost()
        k_max = self.settings.draft_max
        line = DraftLine(self.drafter, prompt, self._picker)
        flight: Flight | None = None
        ahead: Flight | None = None  # sent on the bet that ``flight`` is kept whole
        void: list[Flight] = []  # sent ahead on bets that did not hold
        first = self.settings.cloud_first_token and budget > 0
        try:
            if first and (yield from self._stream_opening(prompt, budget, self.settings.stream_opening, line, ids,
                                                          cloud_part)):
                first = False  # (the cloud opened the answer: the checks go on from its tokens)
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
                # a check is in flight: draft past its block until it lands (sending the line past
                # it as the next check once there is a block of it)
                past = len(flight.block) - flight.known  # the line's tokens the check covers
                if ahead is None and self._may_go_ahead(flight):
                    room = budget - len(ids) - past
                    size = min(room, 1 + cost.block(acceptance.rate, self.draft_min, k_max))
                    line.extend(past + size, flight.future.done)
                    bet = line.tokens[past:past + size]
                    if len(bet) > 1 and not flight.future.done() and len(line.tokens) >= past + size \
                            and math.prod(line.sure[:past + 1]) >= BET_ODDS \
                            and not any(self.drafter.is_end(t) for t in line.tokens[:past]):
                        ahead = self._send(flight.attempt, prompt + ids + line.tokens[:past], bet, cloud_part,
                                           session=self.session.ahead(flight.at + len(flight.block)))
                        self._bets_sent += 1
                beyond = len(ahead.block) - ahead.known if ahead is not None else 0
                line.extend(min(budget - len(ids), past + 1 + beyond + k_max), flight.future.done)
                try:
                    outcome = self._settle(flight, cloud_part)
                except _BetRefused:  # the cloud did not hold what the bet needed: nothing of it is kept
                    flight = None
                    if ahead is not None:
                        void.append(ahead)
                        ahead = None
                    continue
                landed, flight = flight, None
                self._holds_sessions(landed.attempt)
                if outcome is None:  # failed or refused: the edge's block stands
                    kept, extra = landed.block, None
                else:
                    kept, extra = outcome
                    if landed.block and not landed.ahead:
                        # (the prompt's check costs its prefill, a check sent ahead waited for the one
                        # before it: neither is a round's cost)
                        acceptance.observe(len(landed.block), len(kept))
                        cost.observe(len(landed.block) + 1, time.perf_counter() - landed.started)
                    elif landed.ahead:
                        acceptance.observe(len(landed.block) - landed.known, max(0, len(kept) - landed.known))
                if len(kept) < landed.known:  # the cloud no longer picks the token it wrote after the check
                    written: list[int] = []  # before (a tie, computed in another batch): nothing is kept
                    self.session.keep(landed.at)
                else:
                    written = [*kept[landed.known:], *([extra] if extra is not None else [])]
                for i, token in enumerate(written):
                    side = "cloud" if extra is not None and i == len(written) - 1 else "edge"
                    yield from self._write(side, token, ids, edge_part if side == "edge" else cloud_part, budget)
                    if self.finish is not None or len(ids) >= budget:
                        break
                went_on = line.advance(written)
                if ahead is not None:
                    if outcome is not None and extra is not None and len(kept) == len(landed.block) and went_on:
                        flight = ahead  # the bet held: its answer is the next to read
                        self._bets_held += 1
                    else:  # lost: whatever the server computes for it, the next check starts where it did
                        void.append(ahead)
                        self.session.keep(ahead.at)
                    ahead = None
        finally:
            line.close()
            for out in (flight, ahead):
                if out is not None:
                    out.drop()
            self._lost_bets(void, cloud_part)
            edge_part.seconds += line.seconds
        yield from self.emit("edge", self._stream.flush())
        self._rounds_done("pipelined rounds")
        yield from self.final(self.finish or "length")

    def _opener(self, size: int) -> Attempt | None:
        """The cloud that opens the answer by streaming its first ``size`` tokens (None: the prompt's
        check opens it): one that streams token ids and was seen to hold token sessions (the
        checks after the opening then send only what follows it), for a greedy, free answer."""
        if size < 1 or not self._calls_left() or self.grammar is not None or not (
                self.coupling is None or self.coupling.greedy):
            return None
        attempt = self.cloud_attempt()
        if attempt is None:
            return None
        backend = attempt.backend
        if isinstance(backend, Opener) and may(backend, "stream_ids") and backend.capabilities is not None \
                and backend.capabilities.known("sessions") is True:
            return attempt
        attempt.breaker.release()
        return None

    def _stream_opening(self, prompt: list[int], budget: int, size: int, line: DraftLine | None, ids: list[int],
                        part: Part) -> Iterator[ChatCompletionChunk]:
        """The cloud opens the answer: it streams the answer's first ``size`` tokens in one request,
        written as they arrive, at its own pace (an answer that short is the cloud's alone); with a
        ``line`` the edge reads the prompt and drafts past them meanwhile (pipelined rounds), without
        one it waits its turn. Returns whether the cloud opened the answer (False: it cannot, or
        failed before its first token; checks open it then, or the edge writes on alone)."""
        size = min(budget, size)
        attempt = self._opener(size)
        if attempt is None:
            return False
        opener = attempt.backend
        assert isinstance(opener, Opener)
        part.backend = opener.name
        opening = Opening(attempt, opener.generate_in(self.session, prompt, size), _CHECKS)
        ahead = size + self.settings.draft_max  # the edge drafts up to a block past the opening
        token: int | None = None
        try:
            while self.finish is None and len(ids) < budget:
                if line is not None:
                    line.extend(min(budget, ahead) - len(ids), opening.ready)
                token = opening.next()
                if token is None:
                    break
                yield from self._write("cloud", token, ids, part, budget)
                if line is not None:
                    line.advance([token])
            if self._stream.stopped:  # the caller's stop string: nothing more is read
                opening.abort()
            elif token is not None:  # the answer ended at the stream's last token: its usage follows
                while opening.next() is not None:
                    pass
        except (GeneratorExit, EdgeFailed):  # the caller stopped reading, or the edge failed: the cloud stops
            opening.abort()
            raise
        except ExtensionUnsupportedError:  # it streams no token ids (before the first one)
            opening.abort()
            attempt.breaker.release()
            return opening.delivered > 0
        except Exception as exc:  # noqa: BLE001 - an outage: the edge writes on (or the next cloud checks)
            opening.abort()
            self._counted(part)
            self.cloud_failed(attempt, exc, "verification")
            self.span_done("failed", opening.delivered, time.perf_counter() - opening.started)
            self.clouds = [a for a in self.clouds if a is not attempt]
            return opening.delivered > 0
        attempt.breaker.success()
        stream = opening.tokens
        self._counted(part)
        generated = max(stream.generated, opening.delivered)
        sent = stream.sent or len(prompt)  # (an answer cut short reports no usage)
        part.prompt_tokens += sent
        part.cached_tokens += stream.cached
        part.completion_tokens += generated
        part.passes += forward_passes(sent - stream.cached, generated)
        part.seconds += time.perf_counter() - opening.started
        if stream.finish == "stop" and self.finish is None:  # the cloud ended the answer within its opening
            self.finish = "stop"
        self.span_done("opened", generated, time.perf_counter() - opening.started)
        self.recorder.note("cloud_opening", f"the cloud streamed the answer's first {opening.delivered} tokens",
                           opening.delivered)
        return True

    def _may_go_ahead(self, flight: Flight) -> bool:
        """Whether a check may go out before ``flight`` lands: two in flight are allowed, the answer
        is greedy and free (a sampled or grammar-held pick would need the state after the bet), the
        cloud holds the session and is healthy, and it has not refused a bet that held."""
        attempt = flight.attempt
        return (self.settings.checks_in_flight > 1 and self.session.supported is True and self.grammar is None
                and (self.coupling is None or self.coupling.greedy) and attempt in self.clouds
                and attempt.breaker.state == "closed" and _endpoint(attempt) not in _UNORDERED)

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
        if self._bets_sent:
            self.recorder.note("checks_ahead", f"{self._bets_sent} checks went out before the one ahead of them "
                                               f"landed; the bet held for {self._bets_held}", self._bets_held)

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
        tokens = edge_stream(edge.greedy(prompt + ids, budget - len(ids), self._picker()))
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

    def _send(self, attempt: Attempt, tokens: list[int], draft: list[int], part: Part, *, wait: bool = False,
              session: TokenSession | None = None) -> Flight:
        """Send the check of ``draft`` after ``tokens`` to ``attempt``'s cloud (in the session: only
        what it does not hold); ``wait``: answered before this returns, else it lands while the
        edge drafts on; ``session``: a view of the answer's session for a check sent ahead."""
        session = session or self.session
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
            return verifier.score_in(session, context, start=len(tokens), top_n=1, coupling=self.coupling,
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
        return Flight(attempt, list(draft), future, started, len(tokens), session)

    def _settle(self, flight: Flight, part: Part) -> tuple[list[int], int] | None:
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
            if isinstance(exc, SessionExpiredError) and flight.ahead:  # its bet held, and yet the server
                _UNORDERED.add(_endpoint(attempt))  # did not continue from it
                raise _BetRefused() from exc
            self._counted(part)
            self.cloud_failed(attempt, exc, "verification")
            self.span_done("failed", 0, time.perf_counter() - flight.started)
            self.clouds = [a for a in self.clouds if a is not attempt]  # the edge (or the next URL) finishes
            return None
        attempt.breaker.success()
        self._bill(scored, part, flight)
        scores, nxt, draft = scored.scores, scored.next, flight.block
        kept = accept_prefix(draft, [s.choice for s in scores])  # the cloud's greedy choice, or its coupled draw
        extra = scores[kept].choice if kept < len(draft) else nxt.token
        if flight.ahead:  # and the bet held: the server holds what it says
            self.session.held = flight.session.held
        self.session.checked(flight.at, kept, extra, scored)  # the rejected drafts are not context
        self.span_done("verified", 1, time.perf_counter() - flight.started)
        return draft[:kept], extra

    def _bill(self, scored: Scored, part: Part, flight: Flight) -> None:
        """Count what a check that landed cost: a call, its tokens billed and cached, its passes."""
        self._counted(part)
        part.prompt_tokens += scored.sent
        part.cached_tokens += scored.cached
        part.completion_tokens += 1  # the round's next token, generated and billed
        part.passes += forward_passes(scored.sent - scored.cached, 1)
        part.seconds += time.perf_counter() - flight.started

    def _lost_bets(self, void: list[Flight], part: Part) -> None:
        """Checks sent ahead on a bet that did not hold, at the answer's end: what the cloud computed for
        those that landed is billed; one it refused (it held fewer tokens than the bet) cost nothing;
        one still out is dropped uncounted (the server checks in order: it is rare by then)."""
        for flight in void:
            if not flight.future.done():
                flight.future.cancel()
                continue
            with contextlib.suppress(Exception):  # noqa: BLE001 - a lost bet's failure says nothing of the cloud
                self._bill(flight.future.result(), part, flight)

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
