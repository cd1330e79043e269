"""Verified mode: the edge drafts, the cloud checks each draft in one forward pass.

This module owns :class:`VerifiedCollab`: speculative decoding with the draft model on the
device and the target model behind an HTTP endpoint. Each round the edge drafts up to ``k``
greedy tokens; the cloud scores prompt + answer + draft in one request
(:meth:`~edgecloud.remote.client.CloudBackend.score`: ``/v1/completions`` with ``echo`` and
``logprobs``); the longest prefix of the draft the cloud would have written itself is kept,
plus the cloud's own next token (its correction at the first disagreement, or one more token
when it agreed with all of them). So the answer is the cloud's greedy answer, token for token,
while the cloud runs one forward pass per round instead of one per token.

``k`` adapts per answer: acceptance is tracked with the speculative engine's estimator
(:class:`~edgecloud.runtime.speculative.Acceptance`) and ``k`` maximises expected
tokens per second from the measured cost of a draft token and of a cloud round.

Needs an edge runtime that drafts token ids (the llama.cpp backend) and edge and cloud models
that share a tokenizer (one model family); anything else is a
:class:`~edgecloud.errors.ConfigError` at the first request. Sampling parameters are ignored:
verified mode is greedy by definition. A cloud that fails mid-answer leaves the edge to
finish alone (``route.fallbacks`` says so); an edge that fails hands the rest to the cloud.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from ..answer import Part
from ..backend import Drafter, Verifier
from ..errors import ConfigError
from ..fallback import Attempt
from ..runtime.speculative import Acceptance, accept_prefix, best_k
from ..runtime.text_stream import TextStream
from ..types import ChatCompletionChunk, FinishReason
from .run import AnswerRun, SharedAnswer, SharedMode, register_mode

__all__ = ["VerifiedCollab", "VerifiedMode", "choose_k"]

#: Acceptance assumed before the first round (a same-family draft agrees most of the time).
PRIOR_ACCEPTANCE = 0.7
#: Text whose tokens the edge and the cloud must name alike before drafts are verified
#: (letters, digits, punctuation, spaces, a newline, a non-ASCII word).
VOCAB_PROBE = "Hello, world! def f(x):\n    return x * 42  # naïve café 東京"
#: (edge, cloud URL, cloud model) pairs whose vocabularies were found to agree.
_SAME_VOCAB: set[tuple[int, str, str]] = set()


def choose_k(alpha: float, draft_s: float, round_s: float, k_max: int) -> int:
    """The draft length with the most expected tokens per second: ``E[tokens](alpha, k)`` over
    ``k`` draft tokens plus one cloud round."""
    return best_k(alpha, k_max, fixed=round_s, per_token=draft_s)[0]


class VerifiedCollab(SharedAnswer):
    """One answer in verified mode (see the module docstring)."""

    mode = "verified"

    def __init__(self, run: AnswerRun) -> None:
        super().__init__(run)
        if not isinstance(self.edge, Drafter):
            raise ConfigError(f"collab='verified' needs an edge runtime that drafts token ids (llama.cpp); "
                              f"{self.edge.name} does not: use collab='token' or edge_runtime='llamacpp'")
        self.drafter: Drafter = self.edge
        for attempt in self.clouds:
            if not isinstance(attempt.backend, Verifier):
                raise ConfigError(f"collab='verified' needs a cloud client that scores continuations; "
                                  f"{attempt.backend.name} does not: use collab='token'")

    def chunks(self) -> Iterator[ChatCompletionChunk]:
        edge = self.drafter
        prompt = edge.tokenize_chat(self.request.message_dicts())
        if self.request.continue_final_message:
            raise ConfigError("collab='verified' starts answers; to continue a partial answer use collab='token'")
        self.recorder.prompt_tokens = len(prompt)
        room = (edge.n_ctx or 0) - len(prompt) - 1
        budget = min(self.request.max_tokens or room, room)
        text = TextStream(self.request.stop_sequences)
        ids: list[int] = []
        acceptance = Acceptance(PRIOR_ACCEPTANCE)
        draft_s, round_s = 0.02, 0.1  # replaced by measurements after the first round
        k = min(self.settings.draft_max, 4)
        edge_part = self.recorder.part("edge", self.edge.name)
        cloud_part = self.recorder.part("cloud", "cloud")
        finish: FinishReason = "length"
        while len(ids) < budget:
            k = max(1, min(k, budget - len(ids)))
            started = time.perf_counter()
            draft = edge.draft(prompt + ids, k)
            edge_s = time.perf_counter() - started
            edge_part.seconds += edge_s
            attempt = self.cloud_attempt()
            if attempt is None:
                kept, extra = draft, None  # no cloud to check with: the edge writes alone
            else:
                cloud_part.backend = attempt.backend.name
                self._same_vocabulary(edge, attempt)
                checked = self._check(attempt, prompt + ids, draft, cloud_part)
                if checked is None:
                    kept, extra = draft, None
                else:
                    kept, extra = checked
                    acceptance.observe(len(draft), len(kept))
                    draft_s = 0.7 * draft_s + 0.3 * edge_s / max(1, len(draft))
                    round_s = 0.7 * round_s + 0.3 * (time.perf_counter() - started - edge_s)
            for side, token in [*(("edge", t) for t in kept), *((("cloud", extra),) if extra is not None else ())]:
                ids.append(token)
                if edge.is_end(token):
                    finish = "stop"
                    break
                self.recorder.wrote(side, 1)  # type: ignore[arg-type]
                part = edge_part if side == "edge" else cloud_part
                part.completion_tokens += 1
                yield from self.emit(side, text.push(edge.token_bytes(token)),
                                     backend=self.edge.name if side == "edge" else cloud_part.backend)
                if text.stopped:
                    finish = "stop"
                    break
                if len(ids) >= budget:
                    break
            if finish == "stop":
                break
            k = choose_k(acceptance.rate, draft_s, round_s, self.settings.draft_max)
        yield from self.emit("edge", text.flush())
        rounds = self.recorder.cloud_calls
        self.recorder.note("verified_rounds", f"verified by the cloud in {rounds} rounds", rounds)
        yield from self.final(finish)

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
            raise ConfigError(f"collab='verified' needs edge and cloud models with one tokenizer; "
                              f"{edge.model_name} and {backend.model_name} split text differently "
                              f"({mine[:4]} vs {theirs[:4]}): use collab='token'")
        _SAME_VOCAB.add(key)

    def _check(self, attempt: Attempt, tokens: list[int], draft: list[int], part: Part) -> tuple[list[int], int] | None:
        """The kept draft prefix and the cloud's next token, or None when the cloud failed (recorded)."""
        self.recorder.cloud_call()
        part.calls += 1
        started = time.perf_counter()
        verifier = attempt.backend
        assert isinstance(verifier, Verifier)  # checked when the answer started
        try:
            scores, nxt = verifier.score(tokens + draft, start=len(tokens), top_n=1)
        except Exception as exc:  # noqa: BLE001 - classified: a configuration mistake is raised
            self.cloud_failed(attempt, exc, "verification")
            self.span_done("failed", 0, time.perf_counter() - started)
            return None
        attempt.breaker.success()
        part.prompt_tokens += len(tokens) + len(draft)
        part.seconds += time.perf_counter() - started
        kept = accept_prefix(draft, [s.argmax for s in scores])
        extra = scores[kept].argmax if kept < len(draft) else nxt.token
        self.span_done("verified", 1, time.perf_counter() - started)
        return draft[:kept], extra


@register_mode
class VerifiedMode(SharedMode):
    """Verified mode (see the module docstring)."""

    name = "verified"
    can_redact = False
    describe = "the edge writes, the cloud verifies its drafts"
    answer = VerifiedCollab
