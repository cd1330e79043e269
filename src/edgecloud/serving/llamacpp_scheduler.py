"""Continuous batching on llama.cpp: many sequences of one GGUF model in one context, one decode per step.

This module owns :class:`LlamaCppScheduler` and its :class:`LlamaSequence`; the queue, the loop
and failure handling are :class:`~edgecloud.serving.batching.BatchScheduler`'s.

**Slots.** The context holds ``max_batch`` independent KV streams
(:class:`~edgecloud.runtime.llamacpp_batch.MultiSeqContext`, ``kv_unified=False``: attention
reads only its own stream), one per slot. A slot remembers the tokens its KV holds after its
sequence ends, so a new request can go to the free slot whose cache shares the longest prefix
with its prompt, and only the rest of the prompt is evaluated: a conversation's next turn, or
an agent resending its system prompt and tools, prefills only what is new. This is llama.cpp
server's slot reuse, per slot and without copies. Running sequences are kept in the lowest
slots: llama.cpp's attention for a step spans every stream from the step's lowest slot to its
highest, so scattered slots slow every step (8 sequences on slots 0, 2, ..., 14 decode at about
half the speed of 8 on slots 0-7); a slot beyond the running span is taken only for a prefix
that saves at least :data:`SLOT_REUSE_MIN_TOKENS` more prompt tokens.

**A step** is one ``llama_decode``: one token for every decoding sequence (plus its draft
tokens when speculating) and chunks of prompt for sequences still prefilling, at most
``max_prefill_tokens`` of them per step while other sequences decode, so a long prompt never
stalls them for more than one chunk (with none decoding, up to ``n_batch``: one pass). Then each
sequence samples from its own rows of the logits: an ``argmax`` for plain greedy; temperature,
top-k, top-p, min-p, ``logit_bias`` and the seed with the shared-noise sampler
(:class:`~edgecloud.runtime.llamacpp_sampler.CoupledSampler`: the same draws a verified
answer's checks make, so a seed gives one text either way); else (penalties, a grammar) its own
llama.cpp sampler chain; and logprobs when asked.

**Speculation** (a :class:`~edgecloud.serving.speculative.Speculator` with n-gram and/or draft
model proposers, ``k`` chosen per sequence and step by the shared cost model): drafts are
deterministic (greedy drafts, n-gram lookups), and the target verifies them inside the same
decode: at each drafted position the sequence samples its own token exactly as plain decoding
would, and keeps going while that token equals the draft. The output is therefore distributed
exactly as without speculation (identical under greedy), whatever the sampler; the rejected
drafts' KV cells are removed from the slot.

**Scoring** (``/v1/completions`` with ``echo`` + ``logprobs``) runs in the loop thread between
steps on a free slot (:meth:`LlamaCppScheduler.score`), reusing that slot's prefix.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from ..errors import BackendError, BackendUnavailableError
from ..observability.server_metrics import ServerMetrics
from ..runtime.chunks import token_logprob
from ..runtime.llamacpp_batch import MultiSeqContext
from ..runtime.llamacpp_sampler import CoupledSampler, GreedyGrammarSampler
from ..runtime.kv_tiers import SlotKVStore
from ..runtime.prefix_cache import common_prefix_len_np
from ..runtime.sampling import SamplingParams
from ..runtime.coupling import Coupling
from ..runtime.held import HeldPicker
from ..runtime.scoring import TokenScore, score_rows
from .batching import BatchScheduler, BatchSequence
from .speculative import Planned, SpecState, Speculator

__all__ = ["LlamaCppScheduler", "LlamaSequence"]

#: Prompt tokens evaluated per step at most, across the prefilling sequences.
DEFAULT_MAX_PREFILL_TOKENS = 256
#: Prompt tokens a cached prefix must save, beyond the slots within the running span, for a
#: sequence to widen that span (module docstring: a wider span slows every step).
SLOT_REUSE_MIN_TOKENS = 64
#: A slot dropping at least this many tokens of KV keeps them in the engine's KV store (when it has one).
SPILL_MIN_TOKENS = 128


class LlamaSequence(BatchSequence):
    """One request in the llama.cpp scheduler: its slot, how much of its prompt the slot's KV
    holds, its sampler chain (None: plain greedy) and, when asked, each token's logprob."""

    def __init__(
        self, seq_id: int, prompt: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop | None
    ) -> None:
        super().__init__(seq_id, prompt, params, loop)
        self.slot: _Slot | None = None
        #: Prompt tokens whose KV is in the slot.
        self.fed = 0
        self.sampler: Any = None
        self.spec: SpecState | None = None

    @property
    def prefilling(self) -> bool:
        return self.slot is None or self.fed < len(self.prompt)


class _Slot:
    __slots__ = ("index", "tokens", "busy")

    def __init__(self, index: int) -> None:
        self.index = index
        #: The tokens whose KV this slot's stream holds, in position order.
        self.tokens: list[int] = []
        self.busy = False


class LlamaCppScheduler(BatchScheduler[LlamaSequence]):
    """Runs up to ``context.n_seq`` sequences through one llama.cpp context at once.

    ``piece`` gives a token's bytes (for logprobs); ``max_context`` is each slot's room.
    """

    sequence_class = LlamaSequence
    thread_name = "edgecloud-llamacpp"

    def __init__(
        self,
        context: MultiSeqContext,
        *,
        eog_ids: frozenset[int],
        piece: Callable[[int], bytes],
        max_queue: int,
        metrics: ServerMetrics | None = None,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        speculator: Speculator | None = None,
        kv_store: SlotKVStore | None = None,
    ) -> None:
        super().__init__(eog_ids=eog_ids, max_batch=context.n_seq, max_queue=max_queue, max_context=context.room,
                         metrics=metrics)
        self.context = context
        self.piece = piece
        self.max_prefill_tokens = max(1, min(max_prefill_tokens, context.n_batch - context.n_seq))
        self.speculator = speculator
        #: Where prefixes a slot drops are kept, and found again (None: dropped).
        self.kv_store = kv_store
        self.slots = [_Slot(i) for i in range(context.n_seq)]
        self._calls: deque[tuple[Callable[[_Slot], Any], Future[Any], list[int] | None]] = deque()
        self._start()

    # ------------------------------------------------------------------ out-of-band work (scoring)

    def call(self, work: Callable[[_Slot], Any], tokens: list[int] | None = None, timeout: float | None = None) -> Any:
        """Run ``work(slot)`` in the loop thread between steps, on a free slot chosen as for a
        prompt of ``tokens`` (:meth:`_free_slot`); its result."""
        future: Future[Any] = Future()
        with self._cond:
            if self._closed:
                raise BackendUnavailableError("the scheduler is shut down; the server is stopping")
            self._calls.append((work, future, tokens))
            self._cond.notify()
        return future.result(timeout)

    def score(self, tokens: list[int], start: int, top_n: int, coupling: Coupling | None = None,
              held: HeldPicker | None = None) -> tuple[list[TokenScore], TokenScore, int]:
        """Scores of ``tokens[start:]`` (each given what precedes it) and the next token (greedy, or
        the pick: ``coupling``'s draw, held to ``held``'s grammar; with the picks at every
        position), in one pass over the positions the chosen slot does not hold yet; and how many
        leading tokens the slot held (read from its KV, not computed)."""
        return self.call(lambda slot: self._score(slot, tokens, start, top_n, coupling, held), tokens[:start])

    def _has_work(self) -> bool:
        return bool(self._waiting or self._running or self._calls)

    def _between_steps(self) -> None:
        while self._calls:
            work, future, tokens = self._calls[0]
            slot = self._free_slot(tokens)
            if slot is None:
                return  # every slot is generating: the call waits for one to finish
            self._calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(work(slot))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                self._forget(slot)
                future.set_exception(exc)

    def _score(self, slot: _Slot, tokens: list[int], start: int, top_n: int, coupling: Coupling | None,
               held: HeldPicker | None) -> tuple[list[TokenScore], TokenScore, int]:
        ctx = self.context
        reuse = self._reuse(slot, tokens[:start])
        # what the slot lacks of the context and the scored block in one batch (one forward pass
        # per check; a batch of n_batch tokens at most): logits from the row that predicts
        # tokens[start] on
        rows: list[Any] = []
        for first in range(reuse, len(tokens), ctx.n_batch):
            last = min(len(tokens), first + ctx.n_batch)
            ctx.clear()
            for p in range(first, last):
                ctx.add(tokens[p], p, slot.index, p == start - 1 or p >= start)
            ctx.decode()
            if self.metrics is not None:
                self.metrics.on_forward()
            slot.tokens.extend(tokens[first:last])
            rows += [ctx.logits(row).copy() for row, p in enumerate(range(first, last)) if p >= start - 1]
        # rows[i] holds the logits after position start - 1 + i: they predict tokens[start + i]
        return (*score_rows(rows, tokens, start, top_n, coupling, held), reuse)

    # ------------------------------------------------------------------ slots

    def _free_slot(self, prompt: list[int] | None) -> _Slot | None:
        """The free slot for ``prompt``: the one sharing the longest prefix with it among the
        slots up to the highest busy one (or the lowest free slot), the lowest on a tie; a slot
        beyond them only when its prefix saves :data:`SLOT_REUSE_MIN_TOKENS` more tokens."""
        free = [s for s in self.slots if not s.busy]
        if not free:
            return None
        if not prompt:
            return free[0]
        arr = np.asarray(prompt, dtype=np.intc)
        shared = {s.index: common_prefix_len_np(np.asarray(s.tokens, dtype=np.intc), arr) for s in free}
        span = max([free[0].index, *(s.index for s in self.slots if s.busy)])
        inside = max((s for s in free if s.index <= span), key=lambda s: (shared[s.index], -s.index))
        outside = max(free, key=lambda s: (shared[s.index], -s.index))
        return outside if shared[outside.index] - shared[inside.index] >= SLOT_REUSE_MIN_TOKENS else inside

    def _reuse(self, slot: _Slot, prompt: list[int]) -> int:
        """Keep the part of ``slot``'s KV that ``prompt`` starts with (at least one prompt token is
        left to evaluate: its logits give the next token); returns its length."""
        arr = np.asarray(prompt, dtype=np.intc)
        keep = min(common_prefix_len_np(np.asarray(slot.tokens, dtype=np.intc), arr), len(prompt) - 1)
        store = self.kv_store
        if store is not None:
            if len(slot.tokens) - keep >= SPILL_MIN_TOKENS:  # about to drop a prefix worth keeping
                saved = self.context.save_seq(slot.index)
                if saved is not None:
                    store.keep(slot.tokens, *saved)
            found = store.find(prompt, keep)
            if found is not None:
                tokens, state, nbytes = found
                if len(tokens) <= self.context.room and self.context.load_seq(slot.index, state, nbytes):
                    slot.tokens[:] = tokens.tolist()
                    store.restores += 1
                    keep = min(common_prefix_len_np(tokens, arr), len(prompt) - 1)
                else:
                    slot.tokens.clear()
                    keep = 0
        if keep < len(slot.tokens):
            self.context.forget(slot.index, keep)
            del slot.tokens[keep:]
        return keep

    def _forget(self, slot: _Slot) -> None:
        self.context.forget(slot.index)
        slot.tokens.clear()

    # ------------------------------------------------------------------ the engine's part of the loop

    def _admit(self, seq: LlamaSequence) -> None:
        slot = self._free_slot(seq.prompt)
        if slot is None:  # cannot happen: max_batch is the number of slots
            raise BackendError("no free llama.cpp slot for an admitted sequence", cause="runtime_error")
        slot.busy = True
        seq.slot = slot
        seq.fed = seq.cached_tokens = self._reuse(slot, seq.prompt)
        if self.speculator is not None:
            seq.spec = self.speculator.admit(seq.id, seq.params.spec_mode, seq.params.spec_k_max)
        if self.metrics is not None:
            self.metrics.on_admitted(len(seq.prompt), seq.cached_tokens)

    def _release(self, seq: LlamaSequence, error: BaseException | None) -> None:
        slot, seq.slot = seq.slot, None
        if slot is None:
            return
        slot.busy = False
        if error is not None:  # after a failure the stream's cells are not trusted: keep nothing
            self._forget(slot)

    def _finish(self, seq: LlamaSequence, reason: str, error: BaseException | None = None) -> None:
        if self.speculator is not None:
            state = self.speculator.release(seq.id)
            seq.spec = None
            seq.spec_summary = state.summary() if state is not None else None
        sampler, seq.sampler = seq.sampler, None
        if sampler is not None:
            sampler.close()
        super()._finish(seq, reason, error)

    def _on_stop(self) -> None:
        while self._calls:
            _, future, _ = self._calls.popleft()
            if future.set_running_or_notify_cancel():
                future.set_exception(BackendUnavailableError("the scheduler is shut down; the server is stopping"))
        if self.speculator is not None and self.failure is None:
            self.speculator.close()

    def _step(self) -> None:
        ctx = self.context
        ctx.clear()
        planned = self._draft() if self.speculator is not None else {}
        # (sequence, its first row with logits, rows with logits)
        plan: list[tuple[LlamaSequence, int, int]] = []
        carried: list[LlamaSequence] = []
        for seq in self._running:
            if seq.prefilling or seq.cancelled:
                continue
            slot = seq.slot
            assert slot is not None
            fed = [seq.output[-1], *(planned[seq.id].proposal.tokens if seq.id in planned else ())]
            first = ctx.size
            for token in fed:
                ctx.add(token, len(slot.tokens), slot.index, True)
                slot.tokens.append(token)
            plan.append((seq, first, len(fed)))
            carried.append(seq)
        # prompt chunks are capped only where they would hold up sequences decoding in this step:
        # alone, a prompt of up to n_batch tokens is read in one pass (a split one costs a pass
        # more, and a short trailing chunk runs far below the batch's speed)
        budget = min(self.max_prefill_tokens if plan else ctx.n_batch, ctx.n_batch - ctx.size)
        prompt_rows = 0
        for seq in self._running:
            if budget <= 0:
                break
            if not seq.prefilling or seq.cancelled:
                continue
            slot = seq.slot
            assert slot is not None
            chunk = seq.prompt[seq.fed: seq.fed + budget]
            ends = seq.fed + len(chunk) == len(seq.prompt)
            for j, token in enumerate(chunk):
                ctx.add(token, seq.fed + j, slot.index, ends and j == len(chunk) - 1)
            slot.tokens.extend(chunk)
            seq.fed += len(chunk)
            budget -= len(chunk)
            prompt_rows += len(chunk)
            carried.append(seq)
            if ends:
                plan.append((seq, ctx.size - 1, 1))
        if not carried:
            return
        rows = ctx.size
        started = time.perf_counter()
        try:
            ctx.decode()
        except Exception as exc:
            for seq in carried:
                if seq.slot is not None:
                    self._forget(seq.slot)
            self._fail_step(carried, exc, "llama.cpp engine")
            return
        finished_at = time.perf_counter()
        self._observe_step(finished_at - started, rows)
        if self.speculator is not None:
            self.speculator.observe_step(rows, finished_at - started, prefill=prompt_rows > 0)
        decoding = sum(1 for seq, _, _ in plan if seq.output)
        for seq, first, n in plan:
            if seq.cancelled:
                continue
            try:
                self._advance(seq, first, n, planned.get(seq.id), rows, decoding, finished_at)
            except Exception as exc:  # this sequence fails alone; the batch goes on
                self._fail_sequence(seq, exc, "llama.cpp engine")

    def _sample(self, seq: LlamaSequence, row: int, position: int) -> int:
        """``seq``'s next token (at ``position`` of its sequence) from batch row ``row``, with
        logprobs recorded when asked."""
        ctx = self.context
        logits = ctx.logits(row) if seq.sampler is None or seq.top_n is not None else None
        if seq.sampler is None:
            token = int(logits.argmax())  # type: ignore[union-attr]
        elif isinstance(seq.sampler, GreedyGrammarSampler):
            token = seq.sampler.pick(logits if logits is not None else ctx.logits(row))
        elif isinstance(seq.sampler, CoupledSampler):
            token = seq.sampler.pick(logits if logits is not None else ctx.logits(row), position)
        else:
            token = int(ctx.sample(seq.sampler, row))
        if seq.top_n is not None and not (seq.params.stop_at_eog and token in self.eog_ids):
            seq.logprobs.append(token_logprob(logits, token, seq.top_n, self.piece))
        return token

    def _advance(self, seq: LlamaSequence, first: int, n: int, plan: Planned | None, rows: int, decoding: int,
                 at: float) -> None:
        """Sample ``seq``'s rows in order and deliver the tokens. With a draft, sampling stops at the
        first position whose token differs from the drafted one (that token is the target's own);
        the KV cells of the drafts after it are dropped before anything is delivered."""
        drafts = plan.proposal.tokens if plan is not None else []
        tokens: list[int] = []
        for i in range(n):
            token = self._sample(seq, first + i, len(seq.prompt) + len(seq.output) + i)
            tokens.append(token)
            ended = seq.params.stop_at_eog and token in self.eog_ids
            if ended or i >= len(drafts) or token != drafts[i]:
                break
        if plan is not None:
            assert self.speculator is not None and seq.slot is not None
            accepted = len(tokens) - 1
            self.speculator.record(seq.id, plan, accepted, rows=rows, batch=decoding)
            slot = seq.slot
            keep = len(slot.tokens) - len(drafts) + accepted
            self.context.forget(slot.index, keep)
            del slot.tokens[keep:]
        for token in tokens:
            if not self._deliver(seq, token, at):
                break

    def _draft(self) -> dict[int, Planned]:
        """Drafts for this step's decoding sequences (greedy, so verification by sampling is exact)."""
        assert self.speculator is not None
        wanted = []
        for seq in self._running:
            if seq.prefilling or seq.spec is None or seq.cancelled:
                continue
            assert seq.slot is not None
            # room for the last token, the drafts and the token after them, within max_tokens and the slot
            cap = min(seq.remaining - 1, self.max_context - len(seq.slot.tokens) - 2)
            wanted.append((seq.id, seq.prompt + seq.output, 0.0, 1.0, None, cap))
        if not wanted:
            return {}
        rows = len(wanted) + sum(1 for s in self._running if s.prefilling)
        return self.speculator.draft(wanted, rows)
