"""Continuous batching for the torch engine: sequences join and leave the batch at every token.

This module owns :class:`Scheduler` and its :class:`Sequence` (one request's handle: iterate
it, sync or async, for its token ids; ``cancel()`` it). The queue, the loop and failure
handling are :class:`~edgecloud.serving.batching.BatchScheduler`'s, shared with the llama.cpp
engine; this module is what is torch's: KV caches as tensors, the prefix cache of copied
tensors, one flattened forward per step, sampling and speculative verification.

One background thread owns the model. Each step it

1. admits waiting sequences while the running batch has room (``max_batch``), giving each a
   KV cache that starts with the longest prefix found in the prefix cache;
2. builds one flattened batch: a single token for every decoding sequence, plus a chunk of
   prompt for sequences still prefilling (at most ``max_prefill_tokens`` per step, so a
   long prompt never stalls the others for more than one chunk);
3. runs :meth:`~edgecloud.engine.Transformer.forward_batch` once (one matmul per
   layer for all rows; attention per sequence against its own cache);
4. samples each sequence's next token with its own parameters and generator, delivers it,
   and retires sequences that hit an end-of-generation token, their ``max_new_tokens``,
   or were cancelled. A retired sequence's KV goes to the prefix cache.

The waiting queue is bounded: :meth:`Scheduler.submit` raises
:class:`~edgecloud.errors.RateLimitedError` (HTTP 429, with a ``retry_after`` estimate) when it
is full, instead of letting latency grow without bound.

**Prefix cache.** Agents resend the same long prefix (system prompt, tools, the conversation
so far) turn after turn. A finished sequence's KV (prompt + answer) is kept in a byte-bounded
LRU (:class:`~edgecloud.runtime.prefix_cache.PrefixCache`); a new prompt sharing at least
``min_prefix`` tokens with an entry copies that prefix into its cache and prefills only the
rest. Copying (rather than sharing) keeps every sequence's cache private and costs a memory
copy of the prefix, far less than recomputing it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from ..runtime.chunks import token_logprob
from ..runtime.prefix_cache import PrefixCache, SavedPrefix
from ..runtime.sampling import SamplingParams, TokenChooser
from ..errors import BackendError
from ..observability.server_metrics import ServerMetrics
from ..engine import KVCache, Transformer
from .batching import DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE, BatchScheduler, BatchSequence
from .speculative import Planned, SpecState, Speculator

__all__ = ["DEFAULT_MAX_BATCH", "DEFAULT_MAX_QUEUE", "SamplingParams", "Scheduler", "Sequence"]

DEFAULT_MAX_PREFILL_TOKENS = 512
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30
#: Shorter shared prefixes are recomputed: the copy and the lookup would cost about as much.
DEFAULT_MIN_PREFIX = 16
#: A new cache holds the prompt plus this many answer positions, then doubles as needed.
_INITIAL_ANSWER_ROOM = 256


class Sequence(BatchSequence):
    """One request in the torch scheduler: a :class:`~edgecloud.serving.batching.BatchSequence`
    with its own KV cache, sampling generator and speculation state."""

    def __init__(
        self, seq_id: int, prompt: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop | None
    ) -> None:
        super().__init__(seq_id, prompt, params, loop)
        self.cache: KVCache | None = None
        #: Speculation controller while running.
        self.spec: SpecState | None = None
        #: Speculative verification's random stream (seeded with the request's seed).
        self._generator: torch.Generator | None = None
        #: Penalties, bias, greedy or temperature + top-p: the runtime's one token chooser.
        self.chooser = TokenChooser(params)
        #: The grammar the answer is held to (a ``GrammarMask``; ``response_format`` or tool calls), set by the engine.
        self.grammar: Any = None
        if params.seed is not None:
            self._generator = torch.Generator().manual_seed(params.seed)

    @property
    def prefilling(self) -> bool:
        """Whether prompt tokens are still to be scored."""
        return self.cache is None or self.cache.length < len(self.prompt)


class Scheduler(BatchScheduler[Sequence]):
    """Runs many sequences through one :class:`~edgecloud.engine.Transformer` at once."""

    sequence_class = Sequence

    def __init__(
        self,
        model: Transformer,
        *,
        eog_ids: Seq[int] = (),
        max_batch: int = DEFAULT_MAX_BATCH,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
        min_prefix: int = DEFAULT_MIN_PREFIX,
        max_context: int | None = None,
        metrics: ServerMetrics | None = None,
        speculator: Speculator | None = None,
        piece: Callable[[int], bytes] | None = None,
    ) -> None:
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be at least 1, got {max_prefill_tokens}")
        super().__init__(eog_ids=eog_ids, max_batch=max_batch, max_queue=max_queue,
                         max_context=max_context or model.args.context_length, metrics=metrics)
        self.model = model
        self.max_prefill_tokens = max_prefill_tokens
        self.min_prefix = max(1, min_prefix)
        #: Speculative decoding (None: plain decoding); owned by the scheduler thread once running.
        self.speculator = speculator
        #: A token's bytes, for logprobs (their alternatives are named by text).
        self.piece = piece or (lambda token: b"")
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self._start()

    def _loop_context(self) -> AbstractContextManager[Any]:
        return torch.inference_mode()

    def _on_stop(self) -> None:
        if self.speculator is not None and self._closed and self.failure is None:
            self.speculator.close()

    def _admit(self, seq: Sequence) -> None:
        entry, shared = self.prefix_cache.best_match(seq.prompt)
        # A full-prompt hit still re-scores the last prompt token: its logits give the first answer token.
        shared = min(shared, len(seq.prompt) - 1)
        capacity = min(len(seq.prompt) + min(seq.params.max_new_tokens, _INITIAL_ANSWER_ROOM), self.max_context)
        try:
            seq.cache = self.model.new_cache(capacity)
        except RuntimeError as exc:  # out of memory
            error = BackendError(f"could not allocate a KV cache of {capacity} positions: {exc}", cause="out_of_memory")
            self._retire(seq, "error", error)
            return
        if entry is not None and shared >= self.min_prefix:
            state: KVCache = entry.state
            seq.cache.k[:, :shared] = state.k[:, :shared]
            seq.cache.v[:, :shared] = state.v[:, :shared]
            seq.cache.length = shared
            seq.cached_tokens = shared
            self.prefix_cache.touch(entry)
        if self.speculator is not None:
            seq.spec = self.speculator.admit(seq.id, seq.params.spec_mode, seq.params.spec_k_max)
        if self.metrics is not None:
            self.metrics.on_admitted(len(seq.prompt), seq.cached_tokens)

    def _ensure_room(self, seq: Sequence, needed: int) -> None:
        cache = seq.cache
        assert cache is not None
        if needed <= cache.max_tokens:
            return
        grown = self.model.new_cache(min(max(needed, 2 * cache.max_tokens), self.max_context))
        grown.k[:, : cache.length] = cache.k[:, : cache.length]
        grown.v[:, : cache.length] = cache.v[:, : cache.length]
        grown.length = cache.length
        seq.cache = grown

    def _step(self) -> None:
        batch: list[Sequence] = []
        chunks: list[list[int]] = []
        budget = self.max_prefill_tokens
        for seq in self._running:
            assert seq.cache is not None
            if seq.prefilling:
                if budget <= 0:
                    continue
                start = seq.cache.length
                chunk = seq.prompt[start : start + budget]
                budget -= len(chunk)
            else:
                chunk = [seq.output[-1]]
            batch.append(seq)
            chunks.append(chunk)
        prefill = any(seq.prefilling for seq in batch)
        planned = self._draft(batch, sum(len(c) for c in chunks)) if self.speculator is not None else {}
        inputs: list[tuple[torch.Tensor, None, KVCache]] = []
        keep: list[int] = []
        for seq, chunk in zip(batch, chunks):
            assert seq.cache is not None
            plan = planned.get(seq.id)
            if plan is not None:
                chunk = chunk + plan.proposal.tokens
            self._ensure_room(seq, seq.cache.length + len(chunk))
            inputs.append((torch.tensor(chunk, dtype=torch.long), None, seq.cache))
            keep.append(len(chunk) if plan is not None else 1)
        started = time.perf_counter()
        try:
            logits = self.model.forward_batch(inputs, keep=keep)
        except Exception as exc:
            self._fail_step(batch, exc, "torch engine")
            return
        finished_at = time.perf_counter()
        rows = sum(int(t.shape[0]) for t, _, _ in inputs)
        self._observe_step(finished_at - started, rows)
        if self.speculator is not None:
            self.speculator.observe_step(rows, finished_at - started, prefill=prefill)
        decoding = sum(1 for seq in batch if not seq.prefilling)
        # every plain greedy choice of the step in one argmax and one transfer to the host
        greedy = [i for i, seq in enumerate(batch)
                  if not seq.prefilling and seq.params.greedy and seq.id not in planned and not _shaped(seq)]
        picks: dict[int, int] = {}
        if greedy:
            chosen = torch.stack([logits[i][-1] for i in greedy]).argmax(-1).tolist()
            picks = {batch[i].id: token for i, token in zip(greedy, chosen)}
        for seq, row in zip(batch, logits):
            if seq.prefilling or seq.cancelled:
                continue
            try:
                self._advance(seq, row, planned.get(seq.id), rows, decoding, finished_at, picks.get(seq.id))
            except Exception as exc:  # this sequence fails alone; the batch goes on
                self._fail_sequence(seq, exc, "torch engine")

    def _advance(self, seq: Sequence, row: torch.Tensor, plan: Planned | None, rows: int, decoding: int,
                 finished_at: float, picked: int | None = None) -> None:
        """Sample (or verify a draft) from ``row`` and deliver the tokens of one sequence
        (``picked``: its greedy token, already chosen for the whole batch)."""
        if picked is not None:
            tokens = [picked]
        elif _shaped(seq):
            tokens = [self._constrained(seq, row[-1])]
        elif plan is None:
            tokens = [seq.chooser.pick(row[0].float().numpy(), len(seq.prompt) + len(seq.output))]
        else:
            assert self.speculator is not None and seq.cache is not None
            verdict = self.speculator.verify(
                seq.id, plan, row, temperature=seq.params.temperature, top_p=seq.params.top_p,
                generator=seq._generator, rows=rows, batch=decoding,
            )
            # keep the KV of the last delivered token and the accepted drafts; the rest was rejected
            seq.cache.truncate(seq.cache.length - len(plan.proposal.tokens) + verdict.accepted)
            tokens = verdict.tokens
        for token in tokens:
            if not self._deliver(seq, token, finished_at):
                break

    def _constrained(self, seq: Sequence, logits: torch.Tensor) -> int:
        """The next token with the sequence's penalties applied and its grammar (llama.cpp's)
        held, and its logprob recorded when asked (of the model's own distribution, as llama.cpp
        reports it)."""
        raw = logits.float().numpy()
        token = self._choose(seq, raw.copy())
        if seq.top_n is not None and not (seq.params.stop_at_eog and token in self.eog_ids):
            seq.logprobs.append(token_logprob(raw, token, seq.top_n, self.piece))
        return token

    def _choose(self, seq: Sequence, row: np.ndarray) -> int:
        row = seq.chooser.adjust(row, seq.output)
        if seq.grammar is not None and seq.params.greedy:
            return int(seq.grammar.greedy(row))
        token = seq.chooser.pick(seq.grammar.mask(row) if seq.grammar is not None else row,
                                 len(seq.prompt) + len(seq.output))
        if seq.grammar is not None:
            seq.grammar.accept(token)
        return token

    def _draft(self, batch: list[Sequence], rows: int) -> dict[int, Planned]:
        """Drafts for this step's decoding sequences, each capped by its remaining tokens and context."""
        assert self.speculator is not None
        wanted = []
        for seq in batch:
            if seq.prefilling or seq.spec is None or seq.cancelled or _shaped(seq):
                continue  # grammars and penalties are not held across a draft: such answers decode a token a step
            assert seq.cache is not None
            # the last draft position must leave room for the bonus token, within max_tokens and the context
            cap = min(seq.params.max_new_tokens - len(seq.output) - 1, self.max_context - seq.cache.length - 2)
            wanted.append((seq.id, seq.prompt + seq.output, seq.params.temperature, seq.params.top_p,
                           seq._generator, cap))
        return self.speculator.draft(wanted, rows) if wanted else {}

    def _release(self, seq: Sequence, error: BaseException | None) -> None:
        """Keep a finished sequence's KV as a prefix for later prompts (not after an error)."""
        if seq.grammar is not None:
            seq.grammar.close()
        cache, seq.cache = seq.cache, None
        if cache is not None and error is None and cache.length >= self.min_prefix:
            self._remember(seq, cache)

    def _remember(self, seq: Sequence, cache: KVCache) -> None:
        tokens = np.asarray((seq.prompt + seq.output)[: cache.length], dtype=np.intc)
        if cache.max_tokens > cache.length * 5 // 4:  # trim a mostly empty allocation
            trimmed = KVCache(cache.k[:, : cache.length].clone(), cache.v[:, : cache.length].clone())
            trimmed.length = cache.length
            cache = trimmed
        self.prefix_cache.put(SavedPrefix(tokens=tokens, state=cache, nbytes=cache.nbytes))

    def _finish(self, seq: Sequence, reason: str, error: BaseException | None = None) -> None:
        if self.speculator is not None:
            state = self.speculator.release(seq.id)
            seq.spec = None
            seq.spec_summary = state.summary() if state is not None else None
        super()._finish(seq, reason, error)


def _shaped(seq: Sequence) -> bool:
    """Whether the sequence's next token is chosen with a grammar, penalties or a logit bias, or reported with
    its logprobs (one at a time, on the host)."""
    return seq.grammar is not None or seq.params.penalised or bool(seq.params.logit_bias) or seq.top_n is not None
