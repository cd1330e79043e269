"""What ``collab="auto"`` runs, from what the edge runtime and each cloud endpoint can do.

This module owns :func:`auto_mode`, the one place that ranks the shared modes for an answer the
edge may start, best first, and takes the first whose needs the sides meet:

1. ``verified`` - the edge drafts token ids (:class:`~edgecloud.backend.Drafter`) and every cloud
   scores continuations by token id (:class:`~edgecloud.backend.Verifier`, and it has not refused
   ``score`` or ``token_ids``) in a token session (a cloud that holds none, as vLLM, would be sent
   the whole context at every check: many times the bill of asking it alone); nothing is redacted
   (the cloud would see token ids); a request that samples needs every cloud to pick with the
   shared noise (``coupling``: :mod:`edgecloud.runtime.coupling`), one held to a grammar (tool
   calls, ``response_format`` json: :func:`held`) every cloud to check under it (``grammar``:
   :mod:`edgecloud.runtime.held`), and one with presence or frequency penalties is not verified
   (:func:`unverifiable`); a held request that cannot be verified is written by one side (no
   other mode can hand half of a call to the other side's grammar);
2. ``token`` - the edge gives token logprobs and every cloud may continue an assistant message
   (it has not refused ``continue``): the cloud writes text spans where the edge is unsure;
3. ``lead`` - anything else, a cloud that only chats included: the cloud opens each answer and the
   edge takes over where it agrees with the opening (plain chat requests only). On the development
   corpus, held out by family, it beat choosing one side per answer from the edge's first tokens
   (``probe``) on cost at the same quality (``benchmarks/chat_only.py``).

Capabilities are learned as endpoints answer (:mod:`edgecloud.capabilities`): a refusal moves the
next answer — and the refused answer itself, when nothing of it was shown yet — down this list.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..backend import Backend, Drafter, Verifier
from ..capabilities import Capability
from ..runtime.sampling import answer_coupling
from ..types import ChatRequest

__all__ = ["answer_coupling", "auto_mode", "choose_mode", "held", "may", "unverifiable"]


def may(backend: Backend, name: Capability, *, probe: bool = False) -> bool:
    """Whether ``backend`` may be asked for ``name``: a local runtime by its class, an endpoint
    until it refused (``probe``: one cheap request finds out when nobody has asked it yet)."""
    if backend.capabilities is None:
        return True
    return backend.capabilities.find(name) if probe else backend.capabilities.may(name)


def held(request: ChatRequest) -> bool:
    """Whether the answer is held to a grammar: structured output (``response_format`` json) or
    tools the model may call."""
    fmt = request.response_format
    return bool(fmt and fmt.get("type") != "text") or request.tool_mode.mode != "none"


def unverifiable(request: ChatRequest) -> str | None:
    """The request field verified (and checked) mode cannot honour, or None: presence and frequency
    penalties (each side would count a different history)."""
    if request.presence_penalty:
        return "presence_penalty"
    return "frequency_penalty" if request.frequency_penalty else None


def auto_mode(edge: Backend, clouds: Sequence[Backend], *, redacted: bool = False,
              probe: bool = False, request: ChatRequest | None = None) -> tuple[str | None, str]:
    """The mode ``auto`` runs for an answer shared by ``edge`` and ``clouds``, and why (in words);
    None: one side answers. ``probe``: an endpoint not asked yet whether it continues text is
    asked with one cheap request (where an answer already steps down, off the request's path).
    ``request``: how it samples decides whether the clouds must couple (see the module docstring)."""
    if not clouds:
        return None, "no cloud endpoint"
    scores = all(isinstance(c, Verifier) and may(c, "score") and may(c, "token_ids") for c in clouds)
    sessions = all(may(c, "sessions") for c in clouds)
    sampled = request is not None and answer_coupling(request) is not None
    couples = not sampled or all(may(c, "coupling", probe=probe) for c in clouds)
    grammar = request is not None and held(request)
    holds = not grammar or all(may(c, "grammar", probe=probe) for c in clouds)
    penalty = unverifiable(request) if request is not None else None
    drafts = isinstance(edge, Drafter)
    checks = drafts and scores and sessions and not redacted and couples and holds and penalty is None
    continues = checks or all(may(c, "continue", probe=probe) for c in clouds)
    if grammar and not checks:  # a call or a JSON answer cannot be split between the sides: one side writes it
        return None, (f"{_not_verified(edge.name, drafts, scores, sessions, couples, holds, penalty, redacted)}: "
                      "one side writes an answer held to a grammar")
    return choose_mode(runtime=edge.name, drafts=drafts, logprobs=edge.supports_logprobs, scores=scores,
                       continues=continues, redacted=redacted, sessions=sessions, couples=couples and holds,
                       penalty=penalty)


def _not_verified(runtime: str, drafts: bool, scores: bool, sessions: bool, couples: bool, holds: bool,
                  penalty: str | None, redacted: bool) -> str:
    """Why verified mode cannot run, in words (the first need the sides do not meet)."""
    return ("the conversation is redacted (token ids would leak it)" if redacted else
            "the cloud does not score continuations" if not scores else
            f"the {runtime} runtime drafts no token ids" if not drafts else
            "the cloud holds no token sessions (every check would send the whole context again)" if not sessions else
            f"the request's {penalty} needs one history per side" if penalty is not None else
            "the cloud does not check under a grammar" if not holds else
            "the request samples and the cloud does not draw with the edge's noise (coupling)" if not couples else
            "verified mode can run")


def choose_mode(*, runtime: str, drafts: bool, logprobs: bool, scores: bool, continues: bool,
                redacted: bool = False, sessions: bool = True, couples: bool = True,
                penalty: str | None = None) -> tuple[str | None, str]:
    """:func:`auto_mode` from what the sides can do: the edge runtime ``drafts`` token ids and gives
    ``logprobs``; every cloud ``scores`` continuations by token id, holds token ``sessions`` (else
    every check would send the whole context again: vLLM), ``couples`` (samples with the shared
    noise, or the request is greedy) and ``continues`` text; ``penalty``: a request field that
    verified mode cannot honour."""
    if drafts and scores and sessions and couples and penalty is None and not redacted:
        return "verified", "the edge drafts token ids and the cloud scores them"
    why = _not_verified(runtime, drafts, scores, sessions, couples, True, penalty, redacted)
    if logprobs and continues:
        return "token", f"{why}; it continues text"
    if not continues:
        why += " nor continues an assistant message"
    return "lead", f"{why}: the cloud opens each answer, the edge takes over where it agrees"
