"""The torch edge backend: the engine's model on this device's GPU (CUDA or MPS) or CPU, with per-op CPU fallback.

This module owns :class:`TorchBackend` and :class:`TorchStats`. It is the edge twin of the
cloud's :class:`~edgecloud.serving.engine_backend.TorchEngineBackend` for a single user: no
scheduler, one sequence, one KV cache kept between requests. What it reuses rather than
repeats:

- the model and its tokenizer: :meth:`Transformer.from_gguf <edgecloud.engine.Transformer.from_gguf>`
  (float32 on the CPU, float16/bfloat16 on a GPU) and :class:`~edgecloud.engine.Tokenizer`
  (llama.cpp's tokenizer and the GGUF's chat template, so prompts are token-identical to the
  llama.cpp backend's);
- the decode loop: :func:`edgecloud.engine.generate` (prefill, one token per step,
  greedy or temperature / top-p with the request's seed (:class:`~edgecloud.runtime.sampling.TokenChooser`), end-of-generation ids) over the
  kept :class:`~edgecloud.engine.KVCache`; only the prompt after the longest prefix
  shared with what the cache holds is prefilled (``usage.cached_tokens``);
- the chunks: :class:`~edgecloud.runtime.chunks.AnswerChunks`, as for every edge runtime (role
  chunk, whole-UTF-8 content deltas, stop strings never emitted, logprobs when asked, finish
  ``stop`` / ``length``, usage and route on the last chunk), and the sampling defaults of
  :mod:`edgecloud.runtime.sampling` (presence/frequency penalties are refused, naming the field).

**Device and dtype.** ``device="auto"`` takes the GPU :func:`~edgecloud.edge.device.detect_device`
reports (CUDA, else Apple's Metal as ``mps``), else the CPU. ``dtype="auto"`` is float32 on the
CPU, bfloat16 on a CUDA GPU that has it (else float16), float16 on MPS. On macOS
``PYTORCH_ENABLE_MPS_FALLBACK=1`` is set when this module is imported, before torch is.

**Per-op fallback.** The capability table of :mod:`edgecloud.edge.op_fallback` for the chosen
device and dtype, plus any ``unsupported_ops`` given here (or a whole
:class:`~edgecloud.edge.op_fallback.DeviceCaps`), decides which ops run on the CPU; each model
step runs inside a :class:`~edgecloud.edge.op_fallback.CpuFallback` (entered per step, never
across a ``yield``). Fallbacks are counted per op: :attr:`TorchBackend.fallbacks` (since
construction), ``stats.fallbacks``, and the last chunk's ``route.reason`` ("on cpu with torch
(float32); 30 ops fell back to the CPU (scaled_dot_product_attention 30)") for that request.
An op that can run neither on the device nor on the CPU fails the request with
:class:`~edgecloud.errors.BackendUnavailableError` naming it, before any chunk is sent.

**Speculation** (``speculate``, the ``edge_speculate`` setting): prompt lookup verified in one
pass, as on the llama.cpp runtime, with the shared :class:`~edgecloud.edge.speculation.EdgeSpeculator`;
guesses stay within the rows a pass evaluates bitwise like single steps (probed at load, kept on
disk per model, device, dtype and threads), so ``auto`` never changes greedy text. A draft model
is refused (:class:`~edgecloud.errors.ConfigError`).

Loading is lazy (:meth:`TorchBackend.load` or the first request); requests are served one at a
time (:class:`~edgecloud.backend.SerialBackend`); closing the stream stops generation at once.
"""

from __future__ import annotations

import os
import sys

if sys.platform == "darwin":
    # torch reads this when it sets up its MPS backend: it must be set before the first ``import torch``.
    os.environ.setdefault("PYTORCH_ENABLE_MPS_FALLBACK", "1")

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..backend import SerialBackend
from ..engine import DEFAULT_N_CTX, Tokenizer, Transformer, decode_one_token, prefill
from ..errors import BackendError, BackendUnavailableError, ConfigError, EdgeCloudError, InvalidRequestError
from ..types import ChatCompletionChunk, ChatRequest, RouteInfo
from ..runtime.chunks import AnswerChunks, answer_budget
from ..runtime.sampling import TokenChooser, sampling_params
from .device import detect_device
from ..store.catalogue import DEFAULT_MODEL
from .op_fallback import CpuFallback, DeviceCaps, device_caps
from ..runtime.prefix_cache import common_prefix_len_np
from ..runtime.stats import RuntimeStats
from ..runtime.spec_control import SpecState
from .speculation import PROBE_FILLER, PROBE_LONG_CONTEXT, PROBE_TEXT, EdgeSpeculator, Probe, parse_edge_speculate, remembered_probe, spec_usage

__all__ = ["DEFAULT_MODEL", "DTYPES", "TorchBackend", "TorchStats"]

#: Names ``dtype=`` accepts.
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}
_DEVICES = ("auto", "cpu", "cuda", "mps")
#: detect_device()'s GPU backend name -> torch device.
_GPU_DEVICES = {"cuda": "cuda", "metal": "mps"}


@dataclass
class TorchStats(RuntimeStats):
    """Counters since construction."""

    #: Ops run on the CPU instead of the device, per op (live: the fallback's own counter).
    fallbacks: dict[str, int] = field(default_factory=dict)


def _pick_device(device: str) -> str:
    if device not in _DEVICES:
        raise ConfigError(f"unknown device {device!r}; use one of {', '.join(_DEVICES)}")
    if device != "auto":
        return device
    return _GPU_DEVICES.get(detect_device().gpu_backend or "", "cpu")


def _pick_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        if device == "cuda":
            return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float16
        return torch.float16 if device == "mps" else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; use auto or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _fallbacks_text(counts: dict[str, int]) -> str:
    total = sum(counts.values())
    if not total:
        return ""
    detail = ", ".join(f"{name} {n}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return f"; {total} ops fell back to the CPU ({detail})"


class TorchBackend(SerialBackend):
    """A GGUF model run by the torch engine on this device, one request at a time.

    ``model`` is a catalogue name (pulled and verified by :func:`edgecloud.store.resolve_model`)
    or a local ``.gguf`` path. ``device`` is ``auto``, ``cpu``, ``cuda`` or ``mps``; ``dtype``
    ``auto`` or one of :data:`DTYPES`. ``n_ctx`` caps prompt + answer (default: the model's
    context, at most 4096). ``unsupported_ops`` adds op names to the device's capability
    table (they run on the CPU), or replaces the table with a ``DeviceCaps``.
    ``reuse_prefix=False`` prefills every prompt from scratch.
    """

    name = "torch"
    target = "edge"
    supports_logprobs = True
    supports_seed = True
    supports_stop = True

    @classmethod
    def create(cls, model: str, *, n_ctx: int | None = None, device: str = "this",
               cache: Any = None, kv_events: Any = None, speculate: str | None = None) -> TorchBackend:
        """From the client's settings: the torch device is picked here (``device`` names a memory
        profile for the other runtimes, not a torch device)."""
        return cls(model, n_ctx=n_ctx, speculate=speculate)

    def __init__(
        self,
        model: str | Path = DEFAULT_MODEL,
        *,
        device: str = "auto",
        dtype: str = "auto",
        n_ctx: int | None = None,
        unsupported_ops: Iterable[str] | DeviceCaps | None = None,
        reuse_prefix: bool = True,
        speculate: str | None = "auto",
        speculate_k: int | None = None,
    ) -> None:
        if n_ctx is not None and n_ctx < 16:
            raise ConfigError(f"n_ctx must be at least 16 tokens, got {n_ctx}")
        mode, draft = parse_edge_speculate(speculate)
        if draft is not None:
            raise ConfigError(f"edge_speculate {speculate!r}: a draft model needs the llama.cpp edge runtime; the torch "
                              "runtime guesses by prompt lookup (auto or ngram) or decodes plainly (off)")
        #: Prompt-lookup speculation (None: off; see :mod:`edgecloud.edge.speculation`).
        self.speculator = EdgeSpeculator(fixed_k=speculate_k) if mode != "off" else None
        self.model = model
        self.model_name = Path(model).stem if isinstance(model, Path) or str(model).endswith(".gguf") else str(model)
        #: The torch device the model runs on ("cpu", "cuda", "mps").
        self.device = _pick_device(device)
        #: The dtype of weights and activations.
        self.dtype = _pick_dtype(dtype, self.device)
        self.caps = self._caps(unsupported_ops)
        if self.caps.dtype_problem:
            raise ConfigError(f"dtype {self.dtype} cannot be used here: {self.caps.dtype_problem}; use dtype='auto'")
        self.reuse_prefix = reuse_prefix
        self._fallback = CpuFallback(self.caps) if self.caps.unsupported else None
        self._n_ctx_request = n_ctx
        self.n_ctx = 0
        self.model_path: Path | None = None
        self.stats = TorchStats(fallbacks=self._fallback.counts if self._fallback else {})
        self._model: Any = None
        self._tokenizer: Any = None
        self._cache: Any = None
        self._context: list[int] = []  # the tokens whose KV the cache holds, in order
        super().__init__()

    def _caps(self, unsupported_ops: Iterable[str] | DeviceCaps | None) -> DeviceCaps:
        if isinstance(unsupported_ops, DeviceCaps):
            kind = torch.device(unsupported_ops.device).type
            if kind != self.device or unsupported_ops.dtype != self.dtype:
                raise ConfigError(
                    f"the capabilities given are for {kind} ({unsupported_ops.dtype}) but the model runs on "
                    f"{self.device} ({self.dtype})"
                )
            return unsupported_ops
        caps = device_caps(self.device, self.dtype)
        if isinstance(unsupported_ops, str):
            unsupported_ops = [unsupported_ops]
        return caps.declaring(unsupported_ops or ())

    # ------------------------------------------------------------------ lifecycle

    @property
    def loaded(self) -> bool:
        """True once the weights are in memory."""
        return self._model is not None

    @property
    def fallbacks(self) -> dict[str, int]:
        """Ops run on the CPU instead of the device since construction, per op."""
        return dict(self.stats.fallbacks)

    @property
    def transformer(self) -> Any:
        """The loaded :class:`~edgecloud.engine.Transformer` (loads it first if needed)."""
        self.load()
        return self._model

    @property
    def tokenizer(self) -> Any:
        """The loaded :class:`~edgecloud.engine.Tokenizer` (loads it first if needed)."""
        self.load()
        return self._tokenizer

    def fallback_scope(self) -> contextlib.AbstractContextManager[Any]:
        """The context every model step runs in: this backend's CPU fallback, or nothing when no op is declared."""
        return self._fallback if self._fallback is not None else contextlib.nullcontext()

    def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt tokens this backend evaluates for ``messages``."""
        with self._serving():
            _, tokenizer = self._ensure_loaded()
            return tokenizer.encode_chat(messages)

    def score(self, tokens: Sequence[int]) -> torch.Tensor:
        """Teacher-forced logits ``[len(tokens), vocab]`` (float32, on the CPU) of ``tokens`` scored from scratch.

        One forward pass on a fresh cache, under this backend's CPU fallback (counted like any
        other step); the chat's own cache is left as it is.
        """
        with self._serving():
            model, _ = self._ensure_loaded()
            with self.fallback_scope(), torch.inference_mode():
                return model(torch.tensor(list(tokens)), None, model.new_cache(len(tokens))).cpu()

    def _ensure_loaded(self) -> tuple[Any, Any]:
        if self._model is not None:
            return self._model, self._tokenizer
        from ..store import resolve_model

        if self.device == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailableError("device='cuda' was asked for but torch sees no CUDA GPU")
        if self.device == "mps" and not torch.backends.mps.is_available():
            raise BackendUnavailableError("device='mps' was asked for but torch sees no Metal GPU")
        path = resolve_model(self.model, pull=True, progress=False)
        try:
            model = Transformer.from_gguf(path, dtype=self.dtype, device=self.device)
        except (RuntimeError, OSError) as exc:
            raise BackendUnavailableError(f"torch could not load {path} on {self.device}: {exc}") from exc
        tokenizer = Tokenizer(path)
        limit = model.args.context_length
        self.n_ctx = min(self._n_ctx_request, limit) if self._n_ctx_request else min(DEFAULT_N_CTX, limit)
        self._cache = model.new_cache(self.n_ctx)
        self._context = []
        self.model_path, self._model, self._tokenizer = path, model, tokenizer
        if self.speculator is not None:
            self.speculator.calibrate(self._probe_rows)
        return model, tokenizer

    def _probe_rows(self, limit: int) -> Probe:
        """How many rows one pass evaluates with every row's logits bitwise those of one-row
        steps, right after a short context and again after
        :data:`~edgecloud.edge.speculation.PROBE_LONG_CONTEXT` tokens, and the passes timed; kept
        on disk per model, torch version, device, dtype and threads (on its own cache: the
        chat's is left alone)."""
        from ..runtime.hardware import cpu_signature
        from ..store.cache import known_sha256

        assert self.model_path is not None
        where = torch.cuda.get_device_name() if self.device == "cuda" else cpu_signature()
        key = "|".join(["torch", known_sha256(self.model_path), torch.__version__, self.device,
                        str(self.dtype).removeprefix("torch."), str(torch.get_num_threads()), str(limit), where])
        model, tokenizer = self._model, self._tokenizer
        probe = (tokenizer.encode(PROBE_TEXT) * 2)[:limit]
        filler = tokenizer.encode(PROBE_FILLER) * 64

        def rows_exact_after(context: int, tokens: list[int]) -> Probe:
            """:func:`_rows_exact` after ``context`` filler tokens, on a cache of its own."""
            cache = model.new_cache(context + len(tokens) + 1)
            with self.fallback_scope(), torch.inference_mode():
                prefill(model, filler[:context], cache)
                return _rows_exact(model, cache, tokens)

        def measure() -> Probe:
            exact, timed = rows_exact_after(4, probe)
            if exact > 1 and self.n_ctx > PROBE_LONG_CONTEXT + len(probe) + 1:
                exact = min(exact, rows_exact_after(PROBE_LONG_CONTEXT, probe[:exact])[0])
            return exact, timed

        return remembered_probe(key, measure)

    def _free(self) -> None:
        tokenizer, self._tokenizer = self._tokenizer, None
        self._model = self._cache = None
        self._context = []
        if tokenizer is not None:
            tokenizer.close()

    # ------------------------------------------------------------------ the stream

    def stream(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        """Yield the answer as OpenAI-shaped chunks; closing the iterator stops generation."""
        return self._generate(request)

    def _route(self, counts: dict[str, int] | None = None) -> RouteInfo:
        dtype = str(self.dtype).removeprefix("torch.")
        reason = f"on {self.device} with torch ({dtype}){_fallbacks_text(counts or {})}"
        return RouteInfo(target="edge", backend=self.name, reason=reason)

    def _generate(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        for option, value in (("presence_penalty", request.presence_penalty),
                              ("frequency_penalty", request.frequency_penalty)):
            if value:
                raise InvalidRequestError(f"{option} is not supported by the torch edge backend yet", param=option)
        with self._serving():
            model, tokenizer = self._ensure_loaded()
            prompt = tokenizer.encode_request(request)
            params = sampling_params(request, answer_budget(len(prompt), self.n_ctx, request.max_tokens))
            cached = self._reuse_prefix(prompt)
            before = self.fallbacks
            chooser = TokenChooser(params)
            answer = AnswerChunks(
                request, self.model_name, self._route(),
                piece=lambda token: tokenizer.token_to_piece(token, special=False), is_eog=tokenizer.is_eog,
            )
            written = list(prompt)  # the prompt, then every emitted token: what guesses continue
            stats = self.stats
            stats.started(len(prompt), cached)
            spec = self.speculator if self.speculator is not None and self.speculator.disabled is None else None
            state: SpecState | None = spec.state() if spec is not None else None
            try:
                # the prefill: a failure here comes before any chunk
                logits = self._step(lambda: prefill(model, prompt[self._cache.length :], self._cache))
                yield answer.start()
                max_new = params.max_new_tokens
                row = logits.float().cpu().numpy()
                pending = chooser.pick(row)
                while True:
                    token = pending
                    written.append(token)
                    yield from answer.push(token, row)
                    if answer.done or answer.generated >= max_new:
                        break
                    guess: list[int] = []
                    if spec is not None and state is not None:
                        # room for the token, the guess and the token after it, within max_tokens and the context
                        cap = min(max_new - answer.generated - 1, self.n_ctx - self._cache.length - 2)
                        proposer, guess = spec.propose(state, written, cap)
                    started = time.perf_counter()
                    if not guess:
                        row = self._step(lambda: decode_one_token(model, token, self._cache)).float().cpu().numpy()
                        if spec is not None:
                            spec.observe(1, time.perf_counter() - started)
                        pending = chooser.pick(row)
                        continue
                    n_past = self._cache.length
                    rows = self._step(lambda: _forward_rows(model, [token, *guess], self._cache)).float().cpu().numpy()
                    assert spec is not None and state is not None
                    spec.observe(len(guess) + 1, time.perf_counter() - started)
                    accepted = 0
                    for i in range(len(guess) + 1):
                        row = rows[i]
                        pending = chooser.pick(row)
                        if i == len(guess) or pending != guess[i]:
                            break
                        accepted += 1  # the model writes the guessed token itself: emit it
                        written.append(pending)
                        yield from answer.push(pending, row)
                        if answer.done or answer.generated >= max_new:
                            break
                    spec.record(state, proposer, len(guess), accepted)
                    self._cache.truncate(n_past + 1 + accepted)  # the token, then the accepted part of the guess
                    if answer.done or answer.generated >= max_new:
                        break
                answer.route = self._route({k: n - before.get(k, 0) for k, n in self.fallbacks.items()})
                yield from answer.finish(len(prompt), cached, speculative=spec_usage(state))
            except (GeneratorExit, EdgeCloudError):
                raise
            except Exception as exc:
                del written[len(prompt):]
                self._cache.truncate(0)
                raise BackendError(
                    f"the torch backend failed while generating on {self.device}: {exc}", cause="runtime_error"
                ) from exc
            finally:
                stats.completion_tokens += answer.generated  # counted before each chunk is sent
                # the cache holds the prompt and the answer up to its last decoded token
                self._context = written[: self._cache.length]

    def _step(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """One model step (the prefill or one decode step) under the CPU fallback."""
        with self.fallback_scope():
            return run()

    def _reuse_prefix(self, prompt: list[int]) -> int:
        """Keep the longest prefix of ``prompt`` the cache already holds; return its length."""
        keep = 0
        if self.reuse_prefix:
            keep = common_prefix_len_np(np.asarray(self._context, dtype=np.intc), np.asarray(prompt, dtype=np.intc))
            keep = min(keep, len(prompt) - 1)  # the last prompt token is scored again for its logits
        self._cache.truncate(keep)
        self._context = self._context[:keep]
        return keep


@torch.inference_mode()
def _forward_rows(model: Transformer, tokens: list[int], cache: Any) -> torch.Tensor:
    """Evaluate ``tokens`` after what ``cache`` holds in one pass: logits ``[len(tokens), vocab]``
    (row ``i``: the distribution after ``tokens[i]``); the cache then holds them."""
    return model(torch.tensor(tokens, dtype=torch.long), None, cache)


def _rows_exact(model: Transformer, cache: Any, probe: list[int]) -> Probe:
    """The most rows (up to ``len(probe)``) one pass evaluates after what ``cache`` holds with
    logits bitwise those of one-row steps, and the passes timed (each waits for its logits; an
    untimed pass of each shape first takes the device's warm-up, which would otherwise read as a
    large fixed cost per pass and make every guess look free)."""
    start = cache.length
    for rows in range(1, len(probe) + 1):  # untimed: a device's first pass of each shape includes its warm-up
        _forward_rows(model, probe[:rows], cache)
        cache.truncate(start)
    single, timed = [], []
    for token in probe:
        began = time.perf_counter()
        single.append(decode_one_token(model, token, cache).float().cpu())
        timed.append((1, time.perf_counter() - began))
    exact = 1
    for rows in range(2, len(probe) + 1):
        cache.truncate(start)
        began = time.perf_counter()
        out = _forward_rows(model, probe[:rows], cache).float().cpu()
        timed.append((rows, time.perf_counter() - began))
        if not all(torch.equal(out[i], single[i]) for i in range(rows)):
            break
        exact = rows
    cache.truncate(start)
    return exact, timed
