"""Sampling defaults, the one mapping from a request's options to sampler settings, and the one token chooser.

Every runtime (llama.cpp, ONNX Runtime, the torch engine on either side) reads a request's
sampling options through :func:`sampling_params`, so a field left out means the same
everywhere: OpenAI's defaults (temperature 1, top-p 1), llama.cpp's penalty window.

Runtimes that choose tokens themselves from a logits row (ONNX Runtime, torch, Core ML, the
torch serving engine) do it with :class:`TokenChooser`: presence/frequency penalties over the
last :data:`PENALTY_LAST_N` tokens, then ``logit_bias`` (llama.cpp's chain order), then the
greedy argmax or temperature + nucleus (top-p) sampling from :func:`sampling_distribution`
with the request's seed. The llama.cpp runtimes run llama.cpp's own sampler chain, which
orders the same stages the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import InvalidRequestError
from .coupling import Coupling, new_seed

__all__ = [
    "DEFAULT_TEMPERATURE",
    "DEFAULT_TOP_P",
    "GREEDY_BELOW",
    "PENALTY_LAST_N",
    "SamplingParams",
    "TokenChooser",
    "answer_coupling",
    "check_logit_bias",
    "sampling_distribution",
    "sampling_params",
]

#: OpenAI's defaults when a request leaves them out.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
#: How many recent tokens presence/frequency penalties look at (llama.cpp's default).
PENALTY_LAST_N = 64
#: Temperatures below this sample as greedy. Dividing logits by a temperature near zero
#: overflows float32 (1e-50 made every probability NaN and killed the engine); at 1e-4 any
#: logit gap above 0.01 already puts more than 1 - 1e-40 of the mass on the top token.
GREEDY_BELOW = 1e-4


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence samples and when it stops."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    #: Sample among the k most likely tokens (0: all); among those at least ``min_p`` as likely as the top one.
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_at_eog: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: A GBNF grammar every answer must match (``response_format`` json_object / json_schema, tool calls).
    grammar: str | None = None
    #: Regular expressions that switch :attr:`grammar` on when the output so far matches one
    #: (group 1: where the constrained text starts); empty: on from the first token. Tool calls
    #: under ``tool_choice: "auto"``.
    grammar_triggers: tuple[str, ...] = ()
    #: The request field a grammar that does not compile is blamed on.
    grammar_param: str = "response_format"
    #: (token id, bias) pairs added to the logits before sampling (OpenAI's ``logit_bias``).
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: The request's speculation limits: a proposer name or "off" (None: the server's choice), and a cap on k.
    spec_mode: str | None = None
    spec_k_max: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_new_tokens}", param="max_tokens")
        if 0.0 < self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)  # see GREEDY_BELOW

    @property
    def greedy(self) -> bool:
        """True when the next token is always the most likely one."""
        return self.temperature == 0.0

    def coupling(self, *, bias: bool = True) -> Coupling:
        """These settings as the shared-noise sampler (:class:`~edgecloud.runtime.coupling.Coupling`):
        the seed, else a fresh one; ``bias``: the logit bias inside it (False: applied before)."""
        return Coupling(seed=new_seed() if self.seed is None else self.seed, temperature=self.temperature,
                        top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, bias=self.logit_bias if bias else ())

    @property
    def penalised(self) -> bool:
        """True when presence or frequency penalties change the logits."""
        return bool(self.presence_penalty or self.frequency_penalty)


def sampling_params(
    request: Any, max_new_tokens: int, *, logit_bias: bool = False, grammar: bool = False
) -> SamplingParams:
    """The request's sampling options (a chat or completions request) with the defaults filled in.

    ``logit_bias`` / ``grammar``: whether the calling runtime applies a logit bias / holds
    decoding to a grammar (``response_format``); a request that asks a runtime for what it does
    not do is refused here, naming the field (never silently ignored).
    """
    from ..types import ChatRequest

    chat = request if isinstance(request, ChatRequest) else None
    fmt = chat.response_format if chat is not None else None
    wants_grammar = bool(fmt) and fmt.get("type") != "text"
    if wants_grammar and not grammar:
        raise InvalidRequestError("structured output (response_format json_object / json_schema) is not supported by "
                                  "this runtime; the llama.cpp runtime (and edgecloud serve) constrains it", param="response_format")
    tool_mode = chat.tool_mode if chat is not None else None
    tools = tool_mode is not None and tool_mode.mode != "none"
    if tools and tool_mode.mode == "required" and not grammar:
        raise InvalidRequestError("tool_choice 'required' or a named function needs decoding held to the call's "
                                  "schema, which this runtime does not do; use the llama.cpp runtime on the edge "
                                  "(or edgecloud serve), or send tool_choice 'auto'", param="tool_choice")
    bias = request.logit_bias or {}
    if bias and not logit_bias:
        raise InvalidRequestError("logit_bias is not supported by this runtime; the llama.cpp runtime applies it "
                                  "(leave it out here)", param="logit_bias")
    from .tool_grammar import tool_grammar
    from .structured import response_grammar

    calls = tool_grammar(request) if tools and grammar else None
    return SamplingParams(
        grammar=calls.grammar if calls else response_grammar(fmt) if wants_grammar else None,
        grammar_triggers=calls.triggers if calls else (),
        grammar_param="tools" if calls else "response_format",
        logit_bias=tuple((int(token), float(value)) for token, value in bias.items()),
        max_new_tokens=max_new_tokens,
        temperature=DEFAULT_TEMPERATURE if request.temperature is None else request.temperature,
        top_p=DEFAULT_TOP_P if request.top_p is None else request.top_p,
        top_k=max(0, request.top_k or 0),
        min_p=request.min_p or 0.0,
        seed=request.seed,
        stop_at_eog=not request.ignore_eos,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
    )


def answer_coupling(request: Any) -> Coupling | None:
    """How an answer to ``request`` samples when two models write it: None for plain greedy (no
    ``logit_bias``), else its :class:`~edgecloud.runtime.coupling.Coupling` (a fresh seed unless it
    names one). A request that leaves ``temperature`` out samples at 1, as OpenAI's API and the
    cloud alone do."""
    params = sampling_params(request, 1, logit_bias=True, grammar=True)
    return None if params.greedy and not params.logit_bias else params.coupling()


def check_logit_bias(params: SamplingParams, n_vocab: int) -> None:
    """Refuse a ``logit_bias`` that names a token outside a vocabulary of ``n_vocab`` tokens
    (:class:`~edgecloud.errors.InvalidRequestError` naming the field)."""
    bad = next((t for t, _ in params.logit_bias if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"logit_bias names token {bad}, outside this model's vocabulary "
                                  f"(0..{n_vocab - 1})", param="logit_bias")


def sampling_distribution(logits: npt.NDArray[Any], temperature: float, top_p: float = 1.0, top_k: int = 0,
                          min_p: float = 0.0) -> npt.NDArray[np.float64]:
    """Probabilities over the vocabulary (the last axis) after temperature, top-k, nucleus (top-p)
    and min-p truncation, in that order: what a sampled token is drawn from (and what
    speculative verification compares). The top token always stays."""
    wide = np.asarray(logits, dtype=np.float64)
    # shift by the maximum first: the top logit maps to 0 and nothing overflows, however small the
    # temperature or extreme the logits (an inf logit would otherwise give inf - inf = NaN)
    top = np.nan_to_num(wide.max(axis=-1, keepdims=True), nan=0.0, posinf=0.0, neginf=0.0)
    scaled = np.nan_to_num((wide - top) / max(temperature, GREEDY_BELOW), nan=-np.inf)
    probs = np.exp(scaled)
    probs /= probs.sum(axis=-1, keepdims=True)
    if 0 < top_k < probs.shape[-1]:
        kth = -np.partition(-probs, top_k - 1, axis=-1)[..., top_k - 1: top_k]
        probs = np.where(probs >= kth, probs, 0.0)  # (ties at the k-th kept)
        probs /= probs.sum(axis=-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        ranked = np.take_along_axis(probs, order, axis=-1)
        keep = np.cumsum(ranked, axis=-1) - ranked < top_p
        keep[..., 0] = True
        kept = np.zeros_like(probs)
        np.put_along_axis(kept, order, ranked * keep, axis=-1)
        probs = kept / kept.sum(axis=-1, keepdims=True)
    if min_p > 0.0:
        probs = np.where(probs >= min_p * probs.max(axis=-1, keepdims=True), probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


class TokenChooser:
    """The next token from a logits row under one sequence's :class:`SamplingParams` (see the module docstring)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(None if params.seed is None else params.seed % 2**64)  # a negative seed too
        #: Draws by sequence position with the shared noise (what verified checks draw), when the
        #: caller says the position (the serving engine); the bias is already in :meth:`adjust`.
        self.coupling = None if params.greedy else params.coupling(bias=False)

    def adjust(self, row: npt.NDArray[Any], recent: Sequence[int] = ()) -> npt.NDArray[Any]:
        """``row`` with the penalties (over the last :data:`PENALTY_LAST_N` of ``recent``) and the
        logit bias applied: a copy when anything changes."""
        params = self.params
        if not (params.penalised and len(recent)) and not params.logit_bias:
            return row
        row = np.array(row, dtype=np.float32)
        if params.penalised and len(recent):
            ids, counts = np.unique(np.asarray(recent[-PENALTY_LAST_N:], dtype=np.int64), return_counts=True)
            row[ids] -= params.frequency_penalty * counts + params.presence_penalty
        for token, bias in params.logit_bias:  # after the penalties, as llama.cpp's chain orders them
            row[token] += bias
        return row

    def pick(self, row: npt.NDArray[Any], position: int | None = None) -> int:
        """The greedy argmax of an adjusted ``row``, or a draw from its sampling distribution
        (``position`` in the sequence given: the coupled draw there)."""
        if self.params.greedy:
            return int(np.argmax(row))
        if position is not None and self.coupling is not None:
            return self.coupling.pick(row, position)
        params = self.params
        probs = sampling_distribution(row, params.temperature, params.top_p, params.top_k, params.min_p)
        return int(self.rng.choice(probs.size, p=probs))

    def choose(self, row: npt.NDArray[Any], recent: Sequence[int] = ()) -> int:
        """:meth:`adjust`, then :meth:`pick`."""
        return self.pick(self.adjust(row, recent))
