"""Reading a scoring answer (``/completions`` with ``echo`` + ``logprobs``, token ids named
``"token_id:<id>"``) into :class:`~edgecloud.runtime.scoring.Scored`: each position's score, the
next token, what the round sent and what the server holds; an endpoint that does not name
tokens by id is remembered in its capabilities and refused as ``token_ids``."""

from __future__ import annotations

from typing import Any

from ..capabilities import Capabilities
from ..errors import ExtensionUnsupportedError
from ..runtime.scoring import Scored, TokenScore, TokenSession
from .wire import usage_counts

__all__ = ["read_scored"]


def read_scored(logprobs: dict[str, Any], answer: dict[str, Any], tokens: list[int], *, start: int, top_n: int,
                picked: bool, session: TokenSession | None, capabilities: Capabilities, url: str) -> Scored:
    """``logprobs`` (aligned with ``tokens`` plus the next token) and the whole ``answer`` as a
    :class:`Scored` of ``tokens[start:]``; ``picked``: the server picked each position's token
    (a coupled or grammar-held check), its picks are read too."""
    raw_tokens, raw_lps, raw_tops = logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]
    picks = logprobs.get("picks") if picked else None

    def token_id(name: str) -> int:
        if not name.startswith("token_id:"):
            said = f"{url} does not name tokens by id (return_tokens_as_token_ids)"
            capabilities.refuse("token_ids", said)
            raise ExtensionUnsupportedError(f"{said}; cannot verify drafts", extension="token_ids")
        return int(name[len("token_id:"):])

    scores = []
    for i in range(start, len(tokens) + 1):
        top = sorted(((token_id(k), float(v)) for k, v in (raw_tops[i] or {}).items()), key=lambda kv: -kv[1])
        pick = int(picks[i]) if picks is not None and i < len(picks) and picks[i] is not None else None
        scores.append(TokenScore(token=token_id(raw_tokens[i]), logprob=float(raw_lps[i] or 0.0),
                                 top=top[:max(1, top_n)], pick=pick))
    usage = usage_counts(answer.get("usage") or {})
    verified = answer.get("verified") if session is not None and session.supported else None
    kept = ((int(verified["accepted"]), int(verified["token"]))
            if isinstance(verified, dict) and {"accepted", "token"} <= verified.keys() else None)
    return Scored(scores[:-1], scores[-1], sent=usage["prompt_tokens"], cached=usage["cached_tokens"],
                  held=int((answer.get("usage") or {}).get("context_tokens") or 0), verified=kept)
