"""Edge–cloud collaboration inside one answer, decided while decoding.

* :mod:`.gate` — is the edge unsure of its next token (entropy, top-1 probability, margin)?
* :mod:`.token` — token mode: the edge streams; where it is unsure the cloud writes a span.
* :mod:`.verified` — verified mode: the edge drafts, the cloud verifies in one forward pass
  per round; the answer is the cloud's greedy answer.
* :mod:`.run` — what both share: the caller's one stream, parts, failures, the final chunk.

:class:`~edgecloud.hybrid.Hybrid` picks the mode per request (``collab`` on the request or in
the settings; ``auto`` runs token mode for every answer that starts on the edge).
"""

from .gate import Gate, TokenSignals, signals_of
from .run import CollabHooks, CollabRun
from .token import TokenCollab
from .verified import VerifiedCollab

__all__ = ["CollabHooks", "CollabRun", "Gate", "TokenCollab", "TokenSignals", "VerifiedCollab", "signals_of"]
