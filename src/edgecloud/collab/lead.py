"""Lead mode: the cloud opens the answer; the edge takes over where it would have written the same.

This module owns :class:`LeadMode` (``collab="lead"``, what :mod:`.auto` runs for a cloud that only
chats: a hosted API, which neither scores a continuation nor continues an assistant message). It
needs nothing of the cloud but a plain streamed chat request:

1. The cloud answers the request; its tokens stream to the caller at once, so the answer starts
   as fast as the cloud alone would start it. From the cloud's first token on, the edge reads the
   prompt (not before: on a shared machine it would slow the cloud's prefill).
2. Once the cloud has written ``collab.lead_tokens`` tokens, the edge scores them in one pass
   (:class:`~edgecloud.backend.TokenScorer`): the share of them that are its own greedy choice,
   counting only the tokens the cloud wrote itself. A token inside a stretch of at least
   ``collab.lead_copy_ngram`` tokens that the prompt holds verbatim (a function signature, a
   restated question) is one any model copies, and agreeing with it says nothing of whether the
   edge can finish the answer; an opening copied whole counts every token.
3. At least ``collab.lead_agree`` of them: the edge would have written this opening; the cloud's
   stream is closed (it stops generating, and is billed for the prompt and what it wrote) and the
   edge continues the answer from the cloud's text, locally. Fewer: the opening is beyond the edge,
   and the cloud writes the whole answer. An answer the cloud finishes first is the cloud's whole.

The opening is where an answer is decided most often (the fact asked for, the approach, a
function's signature), and where the edge is unsure of it the cloud keeps the answer: measured held
out by task family, 90.6 % of all-cloud quality at 0.50x its bill at p50 (89.8 % at 0.59x counting
the copied tokens too; on 191 tasks the corpus left out, 89.6 % against 87.3 %: the README).
An edge runtime that cannot score text takes over after the lead unconditionally.

Failures go through the one failover: a cloud that fails leaves the edge to write the answer
(mid-stream too); an edge that fails mid-tail hands the rest to a cloud that continues text, if any.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from ..backend import Backend, TokenScorer, close_stream
from ..fallback import continuation
from ..types import ChatCompletionChunk, ChatRequest
from .run import AnswerRun, Mode, register_mode

__all__ = ["Agreement", "LeadMode", "agreement", "copied", "prompt_runs"]


def _read_prompt(edge: Backend, request: ChatRequest) -> threading.Thread:
    """Have the edge read the prompt now (one token): its check and its continuation later read only
    the cloud's text."""
    def run() -> None:
        stream = None
        try:
            stream = edge.stream(request.model_copy(update={"max_tokens": 1, "stream": True, "logprobs": False}))
            for _ in stream:
                pass
        except Exception:  # noqa: BLE001 - a warm-up: the continuation reports a real failure
            pass
        finally:
            close_stream(stream)

    thread = threading.Thread(target=run, name="edgecloud-lead-warm", daemon=True)
    thread.start()
    return thread


def _prompt_tokens(edge: Backend, request: ChatRequest) -> int:
    """The prompt's tokens as the edge counts them (a cloud of another family counts about as many)."""
    if isinstance(edge, TokenScorer):
        try:
            return len(edge.tokenize_chat(request.message_dicts()))
        except Exception:  # noqa: BLE001 - an estimate for the bill; the characters give another
            pass
    return sum(len(m.content or "") for m in request.messages) // 4


def prompt_runs(prompt: Sequence[int], ids: Sequence[int]) -> list[int]:
    """For each position of ``ids``: how many tokens from there on the prompt holds verbatim, in
    order (0: the token does not occur in the prompt)."""
    where: dict[int, list[int]] = {}
    for i, token in enumerate(prompt):
        where.setdefault(token, []).append(i)
    runs = []
    for j, token in enumerate(ids):
        best = 0
        for i in where.get(token, ()):
            n = 1
            while j + n < len(ids) and i + n < len(prompt) and prompt[i + n] == ids[j + n]:
                n += 1
            best = max(best, n)
            if j + best == len(ids):
                break  # nothing longer fits
        runs.append(best)
    return runs


def copied(runs: Sequence[int], ngram: int) -> list[bool]:
    """Which positions lie inside a stretch of at least ``ngram`` tokens the prompt holds verbatim
    (``runs`` from :func:`prompt_runs`; ``ngram`` 0: none counts as copied)."""
    mask = [False] * len(runs)
    if ngram <= 0:
        return mask
    for j, n in enumerate(runs):
        if n >= ngram:
            mask[j:j + n] = [True] * n
    return mask


class Agreement(NamedTuple):
    """How much of the cloud's opening the edge would have written itself."""

    share: float  #: of the counted tokens, the share that are the edge's own greedy choice
    counted: int  #: the tokens counted: those not copied from the prompt (all, where every one was)
    tokens: int  #: the opening's tokens read


def agreement(edge: TokenScorer, messages: list[dict[str, str]], opening: str, tokens: int,
              copy_ngram: int = 0) -> Agreement:
    """The share of the first ``tokens`` tokens of ``opening`` (as the edge splits it) that are the
    edge's own greedy choice after the prompt and the tokens before them, counting only those outside
    a stretch of ``copy_ngram`` or more tokens copied from the prompt (0: counting every token)."""
    prompt = edge.tokenize_chat(messages)
    ids = edge.tokenize_text(opening)[:tokens]
    if not ids:
        return Agreement(1.0, 0, 0)
    scores, _ = edge.score(prompt + ids, start=len(prompt), top_n=1)
    agree = [bool(s.top) and s.top[0][0] == s.token for s in scores]
    own = [a for a, c in zip(agree, copied(prompt_runs(prompt, ids), copy_ngram)) if not c] or agree
    return Agreement(sum(own) / len(own), len(own), len(agree))


@register_mode
class LeadMode(Mode):
    """The cloud opens, the edge takes over where it agrees (see the module docstring)."""

    name = "lead"
    decides_while_writing = True
    cloud_opens = True
    describe = "the cloud opens the answer; the edge writes the rest where it agrees with the opening"

    def chunks(self, run: AnswerRun) -> Iterator[ChatCompletionChunk]:
        edge, request, settings = run.edge, run.request, run.settings
        assert edge is not None
        head = run.failover(attempts=run.clouds + [edge])
        stream = iter(head)
        text, first, seen, took_over = "", None, 0, False
        warm: threading.Thread | None = None
        try:
            for chunk in stream:
                first = first or chunk
                yield chunk
                text += chunk.text
                seen += bool(chunk.text)
                on_cloud = bool(head.parts) and head.parts[-1].side == "cloud"
                if warm is None and chunk.text and on_cloud:
                    # after the cloud's first token, not before: where both sides share a machine the
                    # edge's reading would slow the cloud's own prefill (the answer's first token)
                    warm = _read_prompt(edge.backend, request)
                if seen == settings.lead_tokens and on_cloud:
                    if warm is not None:
                        warm.join()
                    took_over = self._take_over(run, text)
                    if took_over:
                        break
        finally:
            close_stream(stream)  # the cloud stops generating: it is billed for what it wrote
        if not took_over:
            return  # the cloud (or the failover) finished the answer
        cloud = head.parts[-1]
        if not cloud.prompt_tokens:  # closed before its usage came: the prompt is billed all the same
            cloud.prompt_tokens = _prompt_tokens(edge.backend, run.request)
        wrote = sum(p.completion_tokens for p in run.recorder.parts if p.delivered)
        tail = run.failover(continuation(request, text, wrote), attempts=[edge] + run.clouds)
        for chunk in tail:
            if first is not None:
                chunk.id, chunk.created, chunk.model = first.id, first.created, first.model
            if chunk.choices and chunk.choices[0].delta.role and not chunk.text and \
                    chunk.choices[0].finish_reason is None:
                continue  # the continuing side's opening role chunk: the caller had one
            yield chunk

    @staticmethod
    def _take_over(run: AnswerRun, opening: str) -> bool:
        """Whether the edge takes over after the cloud's ``opening`` (noted on the route, why)."""
        edge, settings = run.edge, run.settings
        assert edge is not None
        scorer = edge.backend
        if not isinstance(scorer, TokenScorer):
            run.recorder.note("collab_mode", f"the edge takes over after the cloud's first {settings.lead_tokens} "
                                             f"tokens ({scorer.name} cannot score them)")
            return True
        try:
            agree = agreement(scorer, run.request.message_dicts(), opening, settings.lead_tokens,
                              settings.lead_copy_ngram)
        except Exception:  # noqa: BLE001 - the edge cannot check: the cloud goes on, as it would alone
            run.recorder.note("collab_mode", "the edge could not read the cloud's opening: the cloud writes the answer")
            return False
        took = agree.share >= settings.lead_agree
        which = (f"the {agree.counted} of the cloud's first {agree.tokens} tokens not copied from the prompt"
                 if agree.counted < agree.tokens else f"the cloud's first {agree.tokens} tokens")
        run.recorder.note("collab_mode", f"the edge agreed with {agree.share:.0%} of {which}: "
                                         f"{'the edge writes the rest' if took else 'the cloud writes the answer'}",
                          agree.share)
        return took
