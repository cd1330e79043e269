"""What ``collab="auto"`` runs, from what the edge runtime and each cloud endpoint can do.

This module owns :func:`auto_mode`, the one place that ranks the shared modes for an answer the
edge may start, best first, and takes the first whose needs the sides meet:

1. ``verified`` - the edge drafts token ids (:class:`~edgecloud.backend.Drafter`) and every cloud
   scores continuations by token id (:class:`~edgecloud.backend.Verifier`, and it has not refused
   ``score`` or ``token_ids``) in a token session (a cloud that holds none, as vLLM, would be sent
   the whole context at every check: many times the bill of asking it alone); nothing is redacted
   (the cloud would see token ids);
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

__all__ = ["auto_mode", "choose_mode", "may"]


def may(backend: Backend, name: Capability, *, probe: bool = False) -> bool:
    """Whether ``backend`` may be asked for ``name``: a local runtime by its class, an endpoint
    until it refused (``probe``: one cheap request finds out when nobody has asked it yet)."""
    if backend.capabilities is None:
        return True
    return backend.capabilities.find(name) if probe else backend.capabilities.may(name)


def auto_mode(edge: Backend, clouds: Sequence[Backend], *, redacted: bool = False,
              probe: bool = False) -> tuple[str | None, str]:
    """The mode ``auto`` runs for an answer shared by ``edge`` and ``clouds``, and why (in words);
    None: one side answers. ``probe``: an endpoint not asked yet whether it continues text is
    asked with one cheap request (where an answer already steps down, off the request's path)."""
    if not clouds:
        return None, "no cloud endpoint"
    scores = all(isinstance(c, Verifier) and may(c, "score") and may(c, "token_ids") for c in clouds)
    sessions = all(may(c, "sessions") for c in clouds)
    drafts = isinstance(edge, Drafter)
    checks = drafts and scores and sessions and not redacted
    continues = checks or all(may(c, "continue", probe=probe) for c in clouds)
    return choose_mode(runtime=edge.name, drafts=drafts, logprobs=edge.supports_logprobs, scores=scores,
                       continues=continues, redacted=redacted, sessions=sessions)


def choose_mode(*, runtime: str, drafts: bool, logprobs: bool, scores: bool, continues: bool,
                redacted: bool = False, sessions: bool = True) -> tuple[str | None, str]:
    """:func:`auto_mode` from what the sides can do: the edge runtime ``drafts`` token ids and gives
    ``logprobs``; every cloud ``scores`` continuations by token id, holds token ``sessions`` (else
    every check would send the whole context again: vLLM) and ``continues`` text."""
    if drafts and scores and sessions and not redacted:
        return "verified", "the edge drafts token ids and the cloud scores them"
    why = ("the conversation is redacted (token ids would leak it)" if redacted else
           "the cloud does not score continuations" if not scores else
           f"the {runtime} runtime drafts no token ids" if not drafts else
           "the cloud holds no token sessions (every check would send the whole context again)")
    if logprobs and continues:
        return "token", f"{why}; it continues text"
    if not continues:
        why += " nor continues an assistant message"
    return "lead", f"{why}: the cloud opens each answer, the edge takes over where it agrees"
