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

Each answer is a token session on the cloud (:class:`~edgecloud.remote.session.TokenSession`):
the first round sends the prompt, later rounds only the tokens the cloud has not seen (what the
edge wrote since, and the new block), so the cloud is paid for each token once; a server that
lost the session gets the whole context again (slower, same answer). ``k`` adapts per answer
(:class:`~edgecloud.runtime.speculative.Acceptance` and :func:`~edgecloud.runtime.speculative.best_k`
over the measured cost of a drafted token and of a round).

Needs an edge runtime that drafts token ids (:class:`~edgecloud.backend.Drafter`: the llama.cpp
backend) and edge and cloud models that share a tokenizer; anything else is a
:class:`~edgecloud.errors.ConfigError`. An endpoint that refuses to score (a hosted chat API) or
names other token ids is remembered in its capabilities; under ``collab="auto"`` an answer it
refused before showing anything is written by the next mode :mod:`.auto` ranks, one it refused
later goes on on the edge alone (a route note says which). Sampling parameters are ignored: both
modes are greedy.
A cloud that fails mid-answer leaves the edge to finish alone (``route.fallbacks`` says so); an
edge that fails hands the rest to the cloud.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ..answer import Part
from ..backend import Backend, Drafter, Verifier, close_stream
from ..errors import ConfigError, ExtensionUnsupportedError, VocabularyMismatchError
from ..fallback import Attempt
from ..observability.cost import forward_passes
from ..runtime.scoring import TokenSession
from ..runtime.speculative import Acceptance, accept_prefix, best_k
from ..runtime.text_stream import TextStream
from ..types import ChatCompletionChunk, FinishReason
from .auto import may
from .run import AnswerRun, SharedAnswer, SharedMode, register_mode

__all__ = ["CheckedMode", "DraftAndCheck", "VerifiedMode", "can_score", "choose_k"]

T = TypeVar("T")

#: Acceptance assumed before the first round (a same-family draft agrees most of the time).
PRIOR_ACCEPTANCE = 0.7
#: Text whose tokens the edge and the cloud must name alike before drafts are verified
#: (letters, digits, punctuation, spaces, a newline, a non-ASCII word).
VOCAB_PROBE = "Hello, world! def f(x):\n    return x * 42  # naïve café 東京"
#: (edge, cloud URL, cloud model) pairs whose vocabularies were found to agree.
_SAME_VOCAB: set[tuple[int, str, str]] = set()


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


def _on_edge(call: Callable[..., T], *args: Any) -> T:
    try:
        return call(*args)
    except Exception as exc:  # noqa: BLE001 - the edge's own failure, handed to the failover
        raise _EdgeFailed(exc) from exc


def _edge_stream(tokens: Iterator[tuple[int, float]]) -> Iterator[tuple[int, float]]:
    try:
        yield from tokens
    except Exception as exc:  # noqa: BLE001 - the edge's own failure, handed to the failover
        raise _EdgeFailed(exc) from exc


class DraftAndCheck(SharedAnswer):
    """One answer the edge drafts and the cloud checks (see the module docstring); ``trust`` None:
    every token is checked (verified mode)."""

    mode = "verified"
    trust: float | None = None

    def __init__(self, run: AnswerRun) -> None:
        super().__init__(run)
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
        self.text = ""
        self._stream = TextStream(self.request.stop_sequences)
        self.finish: FinishReason | None = None

    def chunks(self) -> Iterator[ChatCompletionChunk]:
        if self.request.continue_final_message:
            raise ConfigError(f"collab={self.mode!r} starts answers; to continue a partial answer use collab='token'")
        try:
            yield from self._answer()
        except _EdgeFailed as failed:  # the cloud writes the rest, through the one failover
            yield from self.cloud_finishes(failed.error)
        except _StepDown as down:  # nothing shown yet: the next mode writes the whole answer
            yield from self.run.step_down(down.refused, down.by)

    def _answer(self) -> Iterator[ChatCompletionChunk]:
        edge = self.drafter
        prompt = _on_edge(edge.tokenize_chat, self.request.message_dicts())
        self.recorder.prompt_tokens = len(prompt)
        room = (self.edge.n_ctx or 0) - len(prompt) - 1
        budget = min(self.request.max_tokens or room, room)
        ids: list[int] = []
        acceptance = Acceptance(PRIOR_ACCEPTANCE)
        draft_s, round_s = 0.02, 0.1  # replaced by measurements after the first round
        k = max(self.draft_min, min(self.settings.draft_max, 4))
        edge_part = self.recorder.part("edge", self.edge.name)
        cloud_part = self.recorder.part("cloud", "cloud")
        while len(ids) < budget and self.finish is None:
            started = time.perf_counter()
            block: list[int] = []
            if self.trust is not None:  # the edge writes on while it is sure
                yield from self._sure_run(prompt, ids, budget, edge_part, block)
                if self.finish is not None or len(ids) >= budget or not block:
                    break
            k = max(1, min(k, budget - len(ids)))
            if len(block) < k and not (block and edge.is_end(block[-1])):
                block += _on_edge(edge.draft, prompt + ids + block, k - len(block))
            edge_s = time.perf_counter() - started
            edge_part.seconds += edge_s
            attempt = self.cloud_attempt() if self._calls_left() else None
            kept, extra = block, None  # no cloud to check with: the edge writes alone
            if attempt is not None:
                cloud_part.backend = attempt.backend.name
                checked = self._checked(edge, attempt, prompt + ids, block, cloud_part)
                self._holds_sessions(attempt)
                if checked is not None:
                    kept, extra = checked
                    acceptance.observe(len(block), len(kept))
                    draft_s = 0.7 * draft_s + 0.3 * edge_s / max(1, len(block))
                    round_s = 0.7 * round_s + 0.3 * (time.perf_counter() - started - edge_s)
                self.session.keep(len(prompt) + len(ids) + len(kept))  # the rejected drafts are not context
            written = [*(("edge", t) for t in kept), *((("cloud", extra),) if extra is not None else ())]
            for side, token in written:
                yield from self._write(side, token, ids, edge_part if side == "edge" else cloud_part, budget)  # type: ignore[arg-type]
                if self.finish is not None or len(ids) >= budget:
                    break
            k = max(self.draft_min, choose_k(acceptance.rate, draft_s, round_s, self.settings.draft_max))
        yield from self.emit("edge", self._stream.flush())
        calls = self.recorder.cloud_calls
        self.recorder.note("verified_rounds", f"checked by the cloud in {calls} rounds", calls)
        yield from self.final(self.finish or "length")

    def _checked(self, edge: Drafter, attempt: Attempt, tokens: list[int], block: list[int], part: Part
                 ) -> tuple[list[int], int] | None:
        """:meth:`_check`, after the vocabulary check. Under ``collab="auto"`` an endpoint that refuses
        to score (or names other token ids) moves the answer to the next mode ``auto`` ranks when
        nothing was shown yet (the endpoint's capabilities remember it for later answers), else
        this answer goes on on the edge; asked for by name, the refusal is raised."""
        try:
            self._same_vocabulary(edge, attempt)
            return self._check(attempt, tokens, block, part)
        except ExtensionUnsupportedError as refused:
            attempt.breaker.release()
            if not self.run.auto:
                raise
            if not self._opened:
                raise _StepDown(refused, attempt) from refused
            self.clouds = [a for a in self.clouds if a is not attempt]
            self.recorder.note("collab_mode", f"{attempt.label or attempt.backend.name} refused "
                                              f"{refused.extension!r}: the edge writes on alone")
            return None

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
        tokens = _edge_stream(edge.greedy(prompt + ids, budget - len(ids)))
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
        self.recorder.wrote(side, 1)  # type: ignore[arg-type]
        if side == "edge":
            part.completion_tokens += 1  # the cloud's part counts the tokens it was billed for (one a round)
        backend = self.edge.name if side == "edge" else part.backend
        yield from self.emit(side, self._stream.push(edge.token_bytes(token)), backend=backend)
        if self._stream.stopped:
            self.finish = "stop"

    def _same_vocabulary(self, edge: Drafter, attempt: Attempt) -> None:
        """Refuse a cloud whose tokenizer names the probe's tokens differently (checked once per pair)."""
        backend = attempt.backend
        key = (id(edge), str(backend.base_url), backend.model_name)
        if key in _SAME_VOCAB or not isinstance(backend, Verifier):
            return
        tokens = edge.tokenize_text(VOCAB_PROBE)
        if not tokens:
            return
        try:
            theirs = backend.token_texts(tokens)
        except ConfigError:
            attempt.breaker.release()
            raise
        except Exception:  # noqa: BLE001 - an outage, not a mismatch: the first verification reports it
            return
        mine = [edge.token_bytes(t).decode("utf-8", errors="replace") for t in tokens]
        # ASCII pieces read the same through any server's detokenizer (vLLM names partial
        # UTF-8 pieces its own way): those are compared
        if len(theirs) != len(mine) or any(a != b for a, b in zip(mine, theirs) if a.isascii()):
            attempt.breaker.release()
            said = (f"collab={self.mode!r} needs edge and cloud models with one tokenizer; {edge.model_name} and "
                    f"{backend.model_name} split text differently ({mine[:4]} vs {theirs[:4]}): use collab='token'")
            if backend.capabilities is not None:
                backend.capabilities.refuse("token_ids", said)
            raise VocabularyMismatchError(said)
        _SAME_VOCAB.add(key)

    def _check(self, attempt: Attempt, tokens: list[int], draft: list[int], part: Part) -> tuple[list[int], int] | None:
        """The kept draft prefix and the cloud's next token, or None when the cloud failed (recorded)."""
        self.recorder.cloud_call()
        part.calls += 1
        started = time.perf_counter()
        verifier = attempt.backend
        assert isinstance(verifier, Verifier)  # checked when the answer started
        try:
            scored = verifier.score_in(self.session, tokens + draft, start=len(tokens), top_n=1)
            scores, nxt = scored.scores, scored.next
        except ExtensionUnsupportedError:
            raise  # not a failed check: the endpoint cannot check (see _checked)
        except Exception as exc:  # noqa: BLE001 - classified: a configuration mistake is raised
            self.cloud_failed(attempt, exc, "verification")
            self.span_done("failed", 0, time.perf_counter() - started)
            return None
        attempt.breaker.success()
        part.prompt_tokens += scored.sent
        part.cached_tokens += scored.cached
        part.completion_tokens += 1  # the round's greedy next token, generated and billed
        part.passes += forward_passes(scored.sent - scored.cached, 1)
        part.seconds += time.perf_counter() - started
        kept = accept_prefix(draft, [s.argmax for s in scores])
        extra = scores[kept].argmax if kept < len(draft) else nxt.token
        self.span_done("verified", 1, time.perf_counter() - started)
        return draft[:kept], extra


class CheckedAnswer(DraftAndCheck):
    """One answer in checked mode: the edge writes while sure, the cloud checks where it is not."""

    mode = "checked"

    def __init__(self, run: AnswerRun) -> None:
        super().__init__(run)
        self.trust = run.settings.trust


@register_mode
class VerifiedMode(SharedMode):
    """Verified mode: every token checked (see the module docstring)."""

    name = "verified"
    can_redact = False
    describe = "the edge drafts, the cloud verifies every draft (its greedy answer, token for token)"
    answer = DraftAndCheck


@register_mode
class CheckedMode(SharedMode):
    """Checked mode: the cloud checks where the edge is unsure (see the module docstring)."""

    name = "checked"
    can_redact = False
    describe = "the edge writes, the cloud checks the tokens the edge is unsure of"
    answer = CheckedAnswer
