"""The ONNX Runtime edge backend: an INT4 export of a GGUF model run by onnxruntime-genai.

This module owns :class:`OnnxBackend`, the export folder's contract (:class:`ExportManifest`,
the ``edgecloud.json`` that ``edgecloud export onnx`` writes, and :func:`load_manifest`) and
:class:`ByteLevelVocab`, the folder's tokenizer as the decode loop needs it.

What it shares with the llama.cpp backend, so both answer a conversation the same way:

- the prompt is the GGUF's own chat template (:class:`~edgecloud.runtime.chat_template.ChatTemplate`,
  stored in the manifest with the bos/eos strings), tokenized with special tokens parsed and
  no extra BOS; ``tokenizer.json`` was built from the same GGUF vocabulary, and its ids match
  llama.cpp's (``tests/edge/test_onnx_backend.py``);
- generation stops at llama.cpp's end-of-generation ids (recorded at export);
- the decode loop is ours: onnxruntime-genai's ``og.Generator`` runs the model
  (``append_tokens``) and hands back the last position's logits; greedy is an ``argmax``,
  temperature / top-p / penalties / seed are numpy (llama.cpp's sampler chain, in order), and
  each token goes to :class:`~edgecloud.runtime.chunks.AnswerChunks` (end of generation, logprobs,
  whole UTF-8 characters, stop strings held back), as in the llama.cpp backend;
- prefix reuse: the generator (and its KV cache) is kept between requests and rewound to the
  longest prefix the next prompt shares with what it holds (``usage.cached_tokens``).

Loading is lazy (:meth:`OnnxBackend.load` or the first request); requests are served one at a
time (:class:`~edgecloud.backend.SerialBackend`); closing the stream stops generation at once.
A folder without ``genai_config.json`` raises :class:`~edgecloud.errors.ModelNotFoundError`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..backend import TemplatedBackend, refuse_speculation
from ..errors import (
    BackendError,
    BackendUnavailableError,
    ConfigError,
    EdgeCloudError,
    ModelIntegrityError,
)
from ..types import ChatCompletionChunk, ChatRequest, RouteInfo
from ..runtime.chat_template import ChatTemplate
from ..runtime.chunks import AnswerChunks, answer_budget
from .device import detect_device
from .memory import N_BATCH, plan_onnx
from ..store.onnx_manifest import EXPORT_FILE, GENAI_CONFIG, ExportManifest, is_onnx_export, load_manifest
from ..runtime.sampling import TokenChooser, sampling_params
from ..runtime.prefix_cache import common_prefix_len_np
from ..runtime.stats import RuntimeStats

__all__ = [
    "EXPORT_FILE",
    "PREFILL_CHUNK",
    "GENAI_CONFIG",
    "ByteLevelVocab",
    "ExportManifest",
    "OnnxBackend",
    "OnnxStats",
    "is_onnx_export",
    "load_manifest",
]

TOKENIZER_FILE = "tokenizer.json"
#: Prompt tokens per forward pass (llama.cpp's n_batch; the memory planner assumes it too).
PREFILL_CHUNK = N_BATCH


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE token uses -> that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class ByteLevelVocab:
    """A byte-level BPE ``tokenizer.json``: text to ids (special tokens parsed, no BOS added) and
    each id to the bytes llama.cpp renders for it (control tokens as nothing)."""

    def __init__(self, path: Path, vocab_size: int) -> None:
        from tokenizers import Tokenizer

        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises plain Exception
            raise ModelIntegrityError(f"cannot read the tokenizer {path}: {exc}") from exc
        byte_of = _bytes_to_unicode()
        added = self._tokenizer.get_added_tokens_decoder()
        self.pieces: list[bytes] = [b""] * max(vocab_size, self._tokenizer.get_vocab_size(with_added_tokens=True))
        for text, token in self._tokenizer.get_vocab(with_added_tokens=True).items():
            if token in added:
                self.pieces[token] = b"" if added[token].special else text.encode("utf-8")
            elif all(c in byte_of for c in text):
                self.pieces[token] = bytes(byte_of[c] for c in text)
            else:
                self.pieces[token] = text.encode("utf-8")

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (added/special tokens such as ``<|im_start|>`` recognised)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids


#: Counters since load.
OnnxStats = RuntimeStats


def _import_genai() -> Any:
    try:
        import onnxruntime_genai as og
    except ImportError as exc:
        raise BackendUnavailableError(
            "the ONNX Runtime backend needs onnxruntime-genai; run: pip install 'edgecloud[onnx]'"
        ) from exc
    return og


class OnnxBackend(TemplatedBackend):
    """An ``edgecloud export onnx`` folder served on this CPU by onnxruntime-genai, one request at a time.

    ``model`` is the export folder. ``n_ctx`` caps prompt + answer (default: the largest
    context :func:`~edgecloud.edge.memory.plan_onnx` fits in ``device``'s budget, at most 8192);
    the KV cache for that many tokens is allocated once. ``n_threads`` defaults to the physical
    cores (as llama.cpp). ``reuse_prefix=False`` evaluates every prompt from scratch.
    """

    name = "onnx"
    target = "edge"
    supports_logprobs = True
    supports_seed = True
    supports_stop = True

    @classmethod
    def create(cls, model: str, *, n_ctx: int | None = None, device: str = "this",
               cache: Any = None, kv_events: Any = None, speculate: str | None = None) -> OnnxBackend:
        """From the client's settings; a folder that is not an ``edgecloud export onnx`` fails here,
        before anything loads."""
        refuse_speculation(cls.name, speculate)
        load_manifest(model)
        return cls(model, n_ctx=n_ctx, device=device)

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        n_ctx: int | None = None,
        device: str = "this",
        n_threads: int | None = None,
        reuse_prefix: bool = True,
    ) -> None:
        if n_ctx is not None and n_ctx < 16:
            raise ConfigError(f"n_ctx must be at least 16 tokens, got {n_ctx}")
        if n_threads is not None and n_threads < 1:
            raise ConfigError(f"n_threads must be at least 1, got {n_threads}")
        self.path = Path(model).expanduser()
        self.model_name = self.path.name
        self.device = device
        self.reuse_prefix = reuse_prefix
        self.n_threads = n_threads or max(1, int(detect_device().cpu_threads))
        self._n_ctx_request = n_ctx
        self.n_ctx = 0
        self.manifest: ExportManifest | None = None
        self.stats = OnnxStats()
        self._og: Any = None
        self._model: Any = None
        self._params: Any = None
        self._generator: Any = None
        self._context: list[int] = []  # the tokens whose KV the generator holds, in order
        self._vocab: ByteLevelVocab | None = None
        self._template: ChatTemplate | None = None
        self._eog: frozenset[int] = frozenset()
        super().__init__()

    # ------------------------------------------------------------------ lifecycle

    @property
    def loaded(self) -> bool:
        """True once the model is in memory."""
        return self._model is not None

    def _ensure_loaded(self) -> Any:
        if self._model is not None:
            return self._model
        manifest = load_manifest(self.path)
        plan = plan_onnx(self.path, device=self.device, ctx=self._n_ctx_request)
        if not plan.fits:
            raise BackendUnavailableError(f"{self.model_name} does not fit this device: {plan.reason}", cause="out_of_memory")
        og = _import_genai()
        config = og.Config(str(self.path))
        threads = {"intra_op_num_threads": self.n_threads, "inter_op_num_threads": 1}
        config.overlay(json.dumps({"model": {"decoder": {"session_options": threads}}}))
        try:
            model = og.Model(config)
        except Exception as exc:  # onnxruntime-genai raises plain RuntimeError/Exception
            raise BackendUnavailableError(f"onnxruntime-genai could not load {self.path}: {exc}") from exc
        genai = json.loads((self.path / GENAI_CONFIG).read_text(encoding="utf-8"))
        vocab_size = int(genai.get("model", {}).get("vocab_size", 0))
        self._vocab = ByteLevelVocab(self.path / TOKENIZER_FILE, vocab_size)
        self._template = ChatTemplate(manifest.chat_template, bos_token=manifest.bos_token, eos_token=manifest.eos_token)
        self._eog = frozenset(manifest.eog_token_ids)
        self.n_ctx = plan.n_ctx
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=self.n_ctx, batch_size=1)
        self._og, self._model, self._params, self.manifest = og, model, params, manifest
        self._generator, self._context = None, []
        self.stats = OnnxStats()
        return model

    def _free(self) -> None:
        self._generator = self._params = self._model = None
        self._context = []

    # ------------------------------------------------------------------ tokens and KV

    def _encode_chat(
        self, messages: list[dict[str, Any]], *, continue_final: bool = False, tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        assert self._template is not None and self._vocab is not None
        return self._vocab.encode(self._template.prompt(messages, continue_final=continue_final, tools=tools))

    def _prefill(self, prompt: list[int]) -> int:
        """Make the generator hold ``prompt`` with logits for its last token; return the reused count."""
        reuse = 0
        if self.reuse_prefix and self._generator is not None:
            arr = np.asarray(prompt, dtype=np.intc)
            reuse = common_prefix_len_np(np.asarray(self._context, dtype=np.intc), arr)
            reuse = min(reuse, len(prompt) - 1)  # the last prompt token is evaluated again for its logits
        if reuse > 0:
            self._generator.rewind_to(reuse)
        else:
            self._generator = self._og.Generator(self._model, self._params)
        self._context = self._context[:reuse]
        rest = prompt[reuse:]
        if len(rest) > 1:
            self._append(rest[:-1])
        # The last prompt token always runs alone: with int8 activations (accuracy_level 4, the
        # builder's CPU default) MatMulNBits rounds a lone token differently from a batch (logits
        # up to ~0.8 apart), and this way a prompt scores the same whether its prefix came from
        # the cache or not.
        self._append(rest[-1:])
        return reuse

    def _append(self, tokens: list[int]) -> None:
        """Run the model on ``tokens``, at most :data:`PREFILL_CHUNK` at a time: the chunk bounds one
        forward pass's activations, as llama.cpp's n_batch does (the memory plan assumes it)."""
        for start in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[start : start + PREFILL_CHUNK]
            # recorded first: if the run fails the context is dropped anyway (see _generate)
            self._context.extend(chunk)
            self._generator.append_tokens(np.asarray(chunk, dtype=np.int32))

    def _logits(self) -> npt.NDArray[np.single]:
        return np.asarray(self._generator.get_logits(), dtype=np.float32).reshape(-1)

    # ------------------------------------------------------------------ the stream

    def stream(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        """Yield the answer as OpenAI-shaped chunks; closing the iterator stops generation."""
        return self._generate(request)

    def _generate(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        with self._serving():
            self._ensure_loaded()
            prompt = self._encode_chat(request.message_dicts(), continue_final=request.continue_final_message,
                                       tools=request.tool_dicts())
            max_new = answer_budget(len(prompt), self.n_ctx, request.max_tokens)
            try:
                yield from self._decode(request, prompt, max_new)
            except (GeneratorExit, EdgeCloudError):
                raise
            except Exception as exc:
                self._generator, self._context = None, []
                raise BackendError(f"onnxruntime-genai failed while generating: {exc}", cause="runtime_error") from exc

    def _decode(self, request: ChatRequest, prompt: list[int], max_new: int) -> Iterator[ChatCompletionChunk]:
        assert self._vocab is not None
        chooser = TokenChooser(sampling_params(request, max_new))
        generated: list[int] = []
        cached = self._prefill(prompt)  # a failure here comes before any chunk
        stats = self.stats
        stats.started(len(prompt), cached)
        route = RouteInfo(target="edge", backend=self.name, reason=f"on cpu with onnxruntime-genai ({self._precision()})")
        answer = AnswerChunks(request, self.model_name, route, self._vocab.pieces.__getitem__, self._eog.__contains__,
                              stats)
        yield answer.start()
        while answer.generated < max_new:
            logits = self._logits()
            token = chooser.choose(logits, generated)
            generated.append(token)
            yield from answer.push(token, logits)
            if answer.done or answer.generated >= max_new:
                break
            self._append([token])
        yield from answer.finish(len(prompt), cached)

    def _precision(self) -> str:
        m = self.manifest
        return f"{m.precision}, block {m.block_size}" if m is not None else "int4"
