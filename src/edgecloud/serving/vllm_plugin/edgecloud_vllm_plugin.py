"""edgecloud's vLLM plugin: verified-mode checks served from vLLM's prefix cache, in token sessions.

A verified-mode check (:mod:`edgecloud.collab.verified`) is a ``/v1/completions`` request whose
prompt is token ids, with ``echo``, ``logprobs`` and ``max_tokens=1``: the cloud's scores of the
drafted block and its next token. Plain vLLM answers it by recomputing the whole context at every
check: it skips its prefix cache for any request that asks for prompt logprobs, since the
logprobs of cached positions would be missing (vllm-project/vllm#13414). A check needs the
logprobs of its block only, so this plugin gives vLLM what ``edgecloud serve`` does for checks:

- ``score_from: N`` (the position the block starts at): the request may read the prefix cache up
  to position ``N - 1`` (the logits there score the first drafted token), so a check is one pass
  over what the cache lacks, usually the last accepted tokens and the block. Positions before
  ``N`` are answered without logprobs (``null``), as ``edgecloud serve`` answers them. A check
  by token id with no drafted tokens (the prompt's, for the cloud's first token) asks vLLM for no
  prompt logprobs at all: it would compute the logits of every prompt position.
- ``session: {"id", "base"}`` (edgecloud's token sessions, :mod:`edgecloud.serving.sessions`):
  the prompt follows the first ``base`` tokens held for ``id``, so the client sends each token
  once; the answer echoes what was sent, counts it as ``usage.prompt_tokens`` and the held part
  as ``usage.context_tokens``, and names what is held (``session: {"id", "tokens"}``). A session
  not held (expired, or fewer tokens than ``base``) is a 409 of type ``session_expired``: the
  client sends its whole context again, and the answer is unchanged. With
  ``session.keep_verified`` (a check by token id, ``score_from`` set) the session holds only the
  drafts vLLM's greedy choices agree with and its own token after them, named in the answer's
  ``verified: {"accepted", "token"}``, so the client does not send that token back. A check
  without drafts sends no token ids at all (``prompt: []``, ``base`` what is held): it asks for
  the token after what the session holds, one pass over the cache, and the answer says the
  session ``resumes`` so.

Other requests are untouched. ``edgecloud serve --engine vllm`` puts this folder on vLLM's
``PYTHONPATH``, and vLLM loads the plugin in each of its processes (``vllm.general_plugins``, the
``.dist-info`` beside this file). Each patch is applied when vLLM imports its module; one that does
not fit the installed vLLM is left out with a warning, and checks are then served as plain vLLM
serves them. The plugin imports nothing from edgecloud: it runs in vLLM's Python.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from http import HTTPStatus
from types import ModuleType
from typing import Any

#: The ``vllm_xargs`` key that carries a check's ``score_from`` to vLLM's engine.
SCORE_FROM = "edgecloud_score_from"
MAX_SESSIONS = 4096
SESSION_TTL_S = 900.0

_log = logging.getLogger("edgecloud.vllm_plugin")
_registered = False


class Sessions:
    """Token ids per session id, least recently used out (vLLM's API server runs one event loop):
    what ``edgecloud.serving.sessions.SessionStore`` keeps for ``edgecloud serve``, which this
    plugin cannot import (vLLM's Python has no edgecloud)."""

    def __init__(self, max_sessions: int = MAX_SESSIONS, ttl_s: float = SESSION_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_sessions, self.ttl_s, self._clock = max_sessions, ttl_s, clock
        self._held: OrderedDict[str, tuple[float, list[int]]] = OrderedDict()

    def held(self, session_id: str) -> list[int] | None:
        cutoff = self._clock() - self.ttl_s
        while self._held and next(iter(self._held.values()))[0] < cutoff:
            self._held.popitem(last=False)
        found = self._held.get(session_id)
        return None if found is None else found[1]

    def hold(self, session_id: str, tokens: list[int]) -> None:
        self._held[session_id] = (self._clock(), list(tokens))
        self._held.move_to_end(session_id)
        while len(self._held) > self.max_sessions:
            self._held.popitem(last=False)


SESSIONS = Sessions()


def score_from(request: Any) -> int | None:
    """Where an engine request's checked block starts (its ``vllm_xargs``), or None."""
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None)
    start = extra.get(SCORE_FROM) if isinstance(extra, dict) else None
    if getattr(params, "prompt_logprobs", None) is None or not _is_int(start) or start < 1:
        return None
    return int(start)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- the engine's side: read the prefix cache up to the block, and leave unscored rows empty -------


def _patch_request(module: ModuleType) -> None:
    cls = module.Request
    skip = cls.get_skip_reading_prefix_cache

    def get_skip_reading_prefix_cache(self: Any) -> bool:
        return False if score_from(self) is not None else skip(self)

    cls.get_skip_reading_prefix_cache = get_skip_reading_prefix_cache


def _patch_kv_cache_manager(module: ModuleType) -> None:
    cls = module.KVCacheManager
    computed = cls.get_computed_blocks

    def get_computed_blocks(self: Any, request: Any) -> Any:
        start = score_from(request)
        coordinator = getattr(self, "coordinator", None)
        if start is None or coordinator is None:
            return computed(self, request)
        find = coordinator.find_longest_cache_hit

        def capped(block_hashes: Any, max_cache_hit_length: int, *args: Any, **kwargs: Any) -> Any:
            return find(block_hashes, min(max_cache_hit_length, start - 1), *args, **kwargs)

        coordinator.find_longest_cache_hit = capped  # this call only: the scheduler runs one request at a time
        try:
            return computed(self, request)
        finally:
            del coordinator.find_longest_cache_hit

    cls.get_computed_blocks = get_computed_blocks


def _patch_outputs(module: ModuleType) -> None:
    cls = module.LogprobsTensors
    empty = cls.empty_cpu

    def empty_cpu(num_positions: int, num_tokens_per_position: int) -> Any:
        # rows of cached positions are never written: zeros (token 0), not whatever memory held
        tensors = empty(num_positions, num_tokens_per_position)
        for tensor in (tensors.logprob_token_ids, tensors.logprobs, tensors.selected_token_ranks):
            tensor.zero_()
        return tensors

    cls.empty_cpu = staticmethod(empty_cpu)


# -- the API server's side: sessions, score_from, and the answer's shape ---------------------------


def _token_ids(prompt: Any) -> list[int] | None:
    """A prompt of token ids (``[]`` too: a check without drafts that continues a session)."""
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        return list(prompt)
    return None


def _session_ref(extra: dict[str, Any]) -> tuple[str, int] | None | str:
    """(id, base), None (no session), or what is wrong with it."""
    ref = extra.get("session")
    if ref is None:
        return None
    if not isinstance(ref, dict) or not isinstance(ref.get("id"), str) or not ref["id"]:
        return "session must be {'id': a non-empty string, 'base': a token count >= 0}"
    base = ref.get("base", 0)
    if not _is_int(base) or base < 0:
        return "session.base must be a token count >= 0"
    return ref["id"], int(base)


def _patch_completion_serving(module: ModuleType) -> None:
    cls = module.OpenAIServingCompletion
    create = cls.create_completion

    async def create_completion(self: Any, request: Any, raw_request: Any = None) -> Any:
        extra = getattr(request, "model_extra", None) or {}
        prompt = _token_ids(getattr(request, "prompt", None))
        is_check = (bool(getattr(request, "echo", False)) and getattr(request, "logprobs", None) is not None
                    and not getattr(request, "stream", False) and prompt is not None)
        if not is_check or ("session" not in extra and "score_from" not in extra):
            return await create(self, request, raw_request)
        ref = _session_ref(extra)
        start = extra.get("score_from")
        if isinstance(ref, str) or (start is not None and (not _is_int(start) or start < 0)):
            return self.create_error_response(ref if isinstance(ref, str) else "score_from must be a position >= 0",
                                              param="session" if isinstance(ref, str) else "score_from")
        base = ref[1] if ref is not None else 0
        if not prompt and not base:  # nothing sent and nothing held: vLLM says what is missing
            return await create(self, request, raw_request)
        context = prompt
        if ref is not None and base:
            held = SESSIONS.held(ref[0])
            if held is None or len(held) < base:
                have = 0 if held is None else len(held)
                return self.create_error_response(
                    f"session {ref[0]!r} holds {have} tokens here, not the {base} this request continues; "
                    "send the whole context with session.base 0", err_type="session_expired",
                    status_code=HTTPStatus.CONFLICT, param="session")
            context = held[:base] + prompt
        request.prompt = context
        as_ids = bool(getattr(request, "return_tokens_as_token_ids", False))
        echoed = not _is_int(start) or start < len(context) or not as_ids
        if not echoed:  # nothing to score but the next token: no prompt logprobs (the cache serves it all)
            request.echo = False
        elif start >= 1:
            request.vllm_xargs = {**(request.vllm_xargs or {}), SCORE_FROM: int(start)}
        answer = await create(self, request, raw_request)
        if not hasattr(answer, "choices"):
            return answer  # an error, as vLLM answered it
        held = context
        if ref is not None:
            keep = isinstance(extra.get("session"), dict) and extra["session"].get("keep_verified") is True
            verified = _verified(answer, context, start, echoed) if keep and as_ids and _is_int(start) else None
            if verified is not None:
                accepted, token = verified
                held = context[:start + accepted] + [token]
                answer.verified = {"accepted": accepted, "token": token}
            SESSIONS.hold(ref[0], held)
        _shape(answer, context, base, echoed, ref[0] if ref is not None else None, len(held))
        return answer

    respond = cls.request_output_to_completion_response

    def request_output_to_completion_response(self: Any, final_res_batch: Any, request: Any, *args: Any,
                                              **kwargs: Any) -> Any:
        start = (getattr(request, "vllm_xargs", None) or {}).get(SCORE_FROM)
        if _is_int(start):  # positions read from the cache carry no logprobs: none are shown
            for final in final_res_batch:
                scored = final.prompt_logprobs
                for i in range(min(start, len(scored or ()))):
                    scored[i] = None
        return respond(self, final_res_batch, request, *args, **kwargs)

    cls.create_completion = create_completion
    cls.request_output_to_completion_response = request_output_to_completion_response


def _token_id(name: Any) -> int:
    if not isinstance(name, str) or not name.startswith("token_id:"):
        raise ValueError(f"not a token named by id: {name!r}")
    return int(name[len("token_id:"):])


def _verified(answer: Any, context: list[int], start: int, echoed: bool) -> tuple[int, int] | None:
    """A check's kept drafts and vLLM's token after them: the drafted ``context[start:]`` while
    they equal its greedy choices (the best of each position's ``top_logprobs``), then its choice
    at the first that does not, or its generated token after a block it agrees with whole. None
    where the answer does not say (the session then holds the whole context)."""
    logprobs = answer.choices[0].logprobs if answer.choices else None
    if logprobs is None:
        return None
    try:
        if echoed:
            tops = logprobs.top_logprobs[start:len(context)]
            choices = [_token_id(max(top, key=top.get)) for top in tops]
            generated = _token_id(logprobs.tokens[len(context)])
        else:
            choices, generated = [], _token_id(logprobs.tokens[0])
    except (ValueError, IndexError, TypeError, AttributeError):
        return None
    if len(choices) != len(context) - start:
        return None
    accepted = 0
    while accepted < len(choices) and context[start + accepted] == choices[accepted]:
        accepted += 1
    return accepted, choices[accepted] if accepted < len(choices) else generated


def _shape(answer: Any, context: list[int], base: int, echoed: bool, session_id: str | None,
           held: int | None = None) -> None:
    """What was sent, echoed and counted (the held ``base`` tokens as context). An answer asked
    without ``echo`` (only one naming tokens by id is) gets the sent positions in front, unscored."""
    for choice in answer.choices:
        logprobs = choice.logprobs
        if logprobs is None:
            continue
        if echoed:
            for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                values: Sequence[Any] = getattr(logprobs, field)
                setattr(logprobs, field, list(values[base:]))
            continue
        sent = len(context) - base
        logprobs.tokens = [f"token_id:{t}" for t in context[base:]] + list(logprobs.tokens)
        logprobs.token_logprobs = [None] * sent + list(logprobs.token_logprobs)
        logprobs.top_logprobs = [None] * sent + list(logprobs.top_logprobs)
        logprobs.text_offset = [0] * sent + list(logprobs.text_offset)
    usage = answer.usage
    if usage is not None:
        details = getattr(usage, "prompt_tokens_details", None)
        if details is not None and getattr(details, "cached_tokens", None):
            details.cached_tokens = max(0, details.cached_tokens - base)
        usage.prompt_tokens -= base
        usage.total_tokens -= base
        usage.context_tokens = base
    if session_id is not None:
        # (``resumes``: a request may send no token ids and continue from what is held)
        answer.session = {"id": session_id, "tokens": len(context) if held is None else held, "resumes": True}


# -- loading -----------------------------------------------------------------------------------------

PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "vllm.v1.request": _patch_request,
    "vllm.v1.core.kv_cache_manager": _patch_kv_cache_manager,
    "vllm.v1.outputs": _patch_outputs,
    "vllm.entrypoints.openai.completion.serving": _patch_completion_serving,
}


def _apply(name: str, module: ModuleType) -> None:
    try:
        PATCHES[name](module)
    except (AttributeError, TypeError) as exc:
        _log.warning("edgecloud: %s does not fit this vLLM (%s); checks there skip the prefix cache", name, exc)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Applies a module's patch right after vLLM imports it (nothing is imported early)."""

    def __init__(self, pending: dict[str, Callable[[ModuleType], None]]) -> None:
        self.pending = pending

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        del self.pending[name]
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _apply(name, module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def register() -> None:
    """vLLM's entry point, called in each of its processes (a second call does nothing)."""
    global _registered
    if _registered:
        return
    _registered = True
    pending = {}
    for name in PATCHES:
        if name in sys.modules:
            _apply(name, sys.modules[name])
        else:
            pending[name] = PATCHES[name]
    if pending:
        sys.meta_path.insert(0, _AfterImport(pending))
