"""Greedy answers to many independent chats at once on one llama.cpp model.

This module owns :class:`BatchedGreedy`: continuous batching over llama.cpp sequences that
share one KV cache, for offline work where throughput matters and every answer is greedy
(labelling router outcomes, evaluating a model on a task suite). Each decode step feeds the
next token of every running sequence in one ``llama_decode`` call, so the weights are read
once per step instead of once per sequence; a finished sequence frees its cache cells and the
next job takes its slot at once. On this project's 2-core CPU the 1.5B model decodes about
3x more tokens per second with 8 sequences than with one.

Prompts are rendered with the GGUF's own chat template and decoding stops on an
end-of-generation token or ``max_tokens``, as :class:`~edgecloud.edge.llamacpp.LlamaCppBackend`
does; greedy choices match that backend's except where batched arithmetic breaks a near-tie
(llama.cpp's batched kernels round differently from its single-token ones).
"""

from __future__ import annotations

import ctypes
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BackendError, ContextOverflowError, InvalidRequestError
from .chat_template import ChatTemplate
from .chunks import log_partition
from .llama_cpp import physical_cores, token_piece
from .llama_cpp import import_llama_cpp

__all__ = ["BatchJob", "BatchResult", "BatchedGreedy", "MultiSeqContext"]


@dataclass(frozen=True)
class BatchJob:
    """One chat to answer: ``key`` comes back on its result."""

    key: str
    messages: list[dict[str, str]]
    max_tokens: int


@dataclass
class BatchResult:
    """A finished answer: text, why it stopped, token counts and each token's logprob."""

    key: str
    text: str
    finish: str
    prompt_tokens: int
    tokens: int
    logprobs: list[float]
    #: From the job's admission to its last token (shared with the other running sequences).
    seconds: float


@dataclass
class _Running:
    job: BatchJob
    prompt_tokens: int
    started: float
    pos: int
    next_token: int = -1
    pieces: list[bytes] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class MultiSeqContext:
    """A llama.cpp context holding up to ``n_seq`` independent sequences, one KV stream each.

    The low-level pieces :class:`BatchedGreedy` and the speculative draft proposer
    (:mod:`edgecloud.serving.speculative`) share: ``llm`` (the ``Llama`` object: weights,
    tokenizer, metadata; its own context stays tiny), a batch to fill with :meth:`add`,
    :meth:`decode`, the logits of a batch row, and :meth:`forget` to drop a sequence's cells.
    """

    def __init__(
        self, model_path: str | Path, *, n_seq: int, n_ctx: int, n_batch: int, threads: int = 0, verbose: bool = False
    ) -> None:
        self._lib = lib = import_llama_cpp("batched llama.cpp decoding")
        threads = threads or physical_cores()
        self.n_seq, self.n_ctx, self.n_batch = n_seq, n_ctx, n_batch
        self.llm = lib.Llama(model_path=str(model_path), n_ctx=256, n_threads=threads, verbose=verbose)
        self.vocab = self.llm._model.vocab
        self.n_vocab: int = self.llm.n_vocab()
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_batch
        params.n_seq_max, params.n_threads, params.n_threads_batch = n_seq, threads, threads
        # one KV stream per sequence: attention reads only its own cells (a unified cache would
        # make every token attend over every sequence's cells, masked, which dominates a step)
        params.kv_unified = False
        self._ctx = lib.llama_init_from_model(self.llm._model.model, params)
        if not self._ctx:
            self.llm.close()
            raise BackendError(f"llama.cpp could not create a {n_ctx}-token context for {n_seq} sequences")
        self._memory = lib.llama_get_memory(self._ctx)
        self._batch = lib.llama_batch_init(max(n_batch, n_seq), 0, 1)

    @property
    def room(self) -> int:
        """Positions one sequence can hold."""
        return self.n_ctx // self.n_seq

    @property
    def size(self) -> int:
        """Tokens in the batch."""
        return int(self._batch.n_tokens)

    def clear(self) -> None:
        """Empty the batch."""
        self._batch.n_tokens = 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        """Append ``token`` at ``pos`` of sequence ``seq``; returns its batch row."""
        b, i = self._batch, self._batch.n_tokens
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
        b.seq_id[i][0] = seq
        b.n_tokens = i + 1
        return i

    def decode(self) -> None:
        """Run the batch."""
        status = self._lib.llama_decode(self._ctx, self._batch)
        if status != 0:
            raise BackendError(f"llama_decode failed with status {status} (batch of {self._batch.n_tokens} tokens)")

    def logits(self, row: int) -> Any:
        """The logits of batch row ``row`` (added with ``logits=True``), as a numpy view valid until the next decode."""
        return np.ctypeslib.as_array(self._lib.llama_get_logits_ith(self._ctx, row), shape=(self.n_vocab,))

    def sample(self, sampler: Any, row: int) -> int:
        """Sample batch row ``row`` with a llama.cpp sampler chain (a ``LlamaSampler``), which accepts the token."""
        return int(self._lib.llama_sampler_sample(sampler.sampler, self._ctx, row))

    def prefill(self, seq: int, tokens: list[int], start: int = 0) -> Any:
        """Evaluate ``tokens`` at positions ``start...`` of ``seq`` in ``n_batch`` chunks; the last row's logits."""
        for first in range(0, len(tokens), self.n_batch):
            self.clear()
            for j, token in enumerate(tokens[first : first + self.n_batch]):
                self.add(token, start + first + j, seq, first + j == len(tokens) - 1)
            self.decode()
        return self.logits(self.size - 1)

    def forget(self, seq: int, start: int = 0) -> None:
        """Drop positions ``>= start`` of sequence ``seq``."""
        self._lib.llama_memory_seq_rm(self._memory, seq, start, -1)

    def save_seq(self, seq: int) -> tuple[Any, int] | None:
        """A copy of sequence ``seq``'s KV cells (llama.cpp's state format) and its size, or None."""
        size = self._lib.llama_state_seq_get_size(self._ctx, seq)
        if size == 0:
            return None
        buf = (ctypes.c_uint8 * size)()
        written = int(self._lib.llama_state_seq_get_data(self._ctx, buf, size, seq))
        return (buf, written) if written else None

    def load_seq(self, seq: int, state: Any, nbytes: int) -> bool:
        """Replace sequence ``seq``'s cells with a saved state (any sequence's); False if refused."""
        self.forget(seq)
        if self._lib.llama_state_seq_set_data(self._ctx, state, nbytes, seq) == 0:
            self.forget(seq)
            return False
        return True

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends generation."""
        return bool(self._lib.llama_vocab_is_eog(self.vocab, token))

    def close(self) -> None:
        """Free the context, the batch and the model."""
        if self._ctx is not None:
            self._lib.llama_batch_free(self._batch)
            self._lib.llama_free(self._ctx)
            self._ctx = None
            self.llm.close()


class BatchedGreedy:
    """Answer many chats greedily with up to ``parallel`` sequences decoding together.

    ``n_ctx`` is the whole KV cache, split evenly into one stream per sequence; a job whose
    prompt plus ``max_tokens`` does not fit one stream (``n_ctx // parallel`` tokens) is
    refused with :class:`ContextOverflowError` before anything runs.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        parallel: int = 8,
        n_ctx: int = 16384,
        n_batch: int = 512,
        threads: int = 0,
        verbose: bool = False,
    ) -> None:
        if parallel < 1:
            raise InvalidRequestError(f"parallel must be at least 1, got {parallel}", param="parallel")
        if n_ctx < 256:
            raise InvalidRequestError(f"n_ctx must be at least 256, got {n_ctx}", param="n_ctx")
        from ..store import resolve_model

        self.parallel, self.n_ctx, self.n_batch = parallel, n_ctx, n_batch
        self.model_path = resolve_model(model, pull=True)
        self._seqs = MultiSeqContext(
            self.model_path, n_seq=parallel, n_ctx=n_ctx, n_batch=n_batch, threads=threads, verbose=verbose
        )
        self._llm = llm = self._seqs.llm
        self._lib, self._vocab = self._seqs._lib, self._seqs.vocab
        bos, eos = llm.token_bos(), llm.token_eos()
        self._template = ChatTemplate.from_gguf_metadata(
            llm.metadata,
            bos_token=llm._model.token_get_text(bos) if bos != -1 else "",
            eos_token=llm._model.token_get_text(eos) if eos != -1 else "",
        )
        self._pieces: dict[int, bytes] = {}

    # ------------------------------------------------------------------ public

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt tokens for ``messages`` (chat template + tokenizer)."""
        text = self._template.prompt(messages)
        return self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def run(self, jobs: Iterable[BatchJob]) -> Iterator[BatchResult]:
        """Answer every job; results come in the order the answers finish."""
        waiting: deque[tuple[BatchJob, list[int]]] = deque()
        source = iter(jobs)
        running: dict[int, _Running] = {}
        free = list(range(self.parallel - 1, -1, -1))
        room = self.n_ctx // self.parallel
        exhausted = False
        while True:
            # admit: fill free slots while the cache has room for prompt + max_tokens
            while free:
                if not waiting and not exhausted:
                    job = next(source, None)
                    if job is None:
                        exhausted = True
                    else:
                        waiting.append((job, self.encode(job.messages)))
                if not waiting:
                    break
                job, prompt = waiting[0]
                if job.max_tokens < 1:
                    raise InvalidRequestError(f"max_tokens must be at least 1 (job {job.key!r})", param="max_tokens")
                if len(prompt) + job.max_tokens > room:
                    raise ContextOverflowError(
                        len(prompt), room, detail=f" plus max_tokens={job.max_tokens} (job {job.key!r})"
                    )
                waiting.popleft()
                seq = free.pop()
                state = _Running(job, len(prompt), time.perf_counter(), pos=len(prompt))
                logits = self._seqs.prefill(seq, prompt)
                done = self._take(state, logits)
                if done is None:
                    running[seq] = state
                else:
                    yield self._finish(seq, state, done)
                    free.append(seq)
            if not running:
                return  # nothing running means no free slot was refused: every job is done
            # one decode step for every running sequence
            order = list(running)
            self._seqs.clear()
            for seq in order:
                state = running[seq]
                self._seqs.add(state.next_token, state.pos, seq, True)
            self._seqs.decode()
            for i, seq in enumerate(order):
                state = running[seq]
                state.pos += 1
                done = self._take(state, self._seqs.logits(i))
                if done is not None:
                    del running[seq]
                    yield self._finish(seq, state, done)
                    free.append(seq)

    def close(self) -> None:
        """Free the context, the batch and the model."""
        self._seqs.close()

    def __enter__(self) -> BatchedGreedy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _take(self, state: _Running, logits: Any) -> str | None:
        """Choose the next token greedily; the finish reason once the sequence is done."""
        token = int(logits.argmax())
        if self._lib.llama_vocab_is_eog(self._vocab, token):
            return "stop"
        state.logprobs.append(min(0.0, float(logits[token]) - log_partition(logits)))
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = token_piece(self._lib, self._vocab, token)
        state.pieces.append(piece)
        state.next_token = token
        return "length" if len(state.pieces) >= state.job.max_tokens else None

    def _finish(self, seq: int, state: _Running, finish: str) -> BatchResult:
        self._seqs.forget(seq)
        return BatchResult(
            key=state.job.key,
            text=b"".join(state.pieces).decode("utf-8", errors="replace"),
            finish=finish,
            prompt_tokens=state.prompt_tokens,
            tokens=len(state.pieces),
            logprobs=state.logprobs,
            seconds=round(time.perf_counter() - state.started, 3),
        )
