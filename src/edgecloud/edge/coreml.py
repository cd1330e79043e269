"""The Core ML edge backend: a package built by ``edgecloud export coreml``, run by Core ML on a Mac.

This module owns :class:`CoreMLBackend` and the host side of the exported model's contract
(:mod:`edgecloud.quant.export_coreml` owns the model side):

- :func:`stream_answer`: one answer's chunks from any *step* function
  ``step(new_tokens, filled) -> logits[vocab]`` that scores the new tokens after ``filled``
  cached ones: one step over the whole prompt (before any chunk is sent), then one per token.
  On a Mac the step is one ``MLModel.predict`` with the ``input_ids`` and
  :func:`~edgecloud.quant.export_coreml.causal_mask` inputs on the request's own state
  (``make_state``); elsewhere the same function runs over the traced torch decoder the package
  is converted from, which is how the tests hold it to the engine's own
  :func:`~edgecloud.engine.generate`. Sampling is the engine's
  :class:`~edgecloud.runtime.sampling.TokenChooser` (greedy, or temperature / top-p with the
  request's seed) with OpenAI's defaults; the chunks (end of generation unless ``ignore_eos``,
  logprobs from the step's logits, UTF-8-safe deltas, stop strings held back, finish, usage,
  route) come from :class:`~edgecloud.runtime.chunks.AnswerChunks`, as for the other edge runtimes.
- :func:`coreml_unavailable_reason`: why this machine cannot run Core ML predictions (Core
  ML states need macOS 15); :class:`CoreMLBackend` raises
  :class:`~edgecloud.errors.BackendUnavailableError` with it when constructed elsewhere.

The tokenizer is the package's own vocabulary-only GGUF, loaded by the engine's
:class:`~edgecloud.engine.Tokenizer` (llama.cpp, ``vocab_only``), so prompts are
token-identical to the llama.cpp and torch backends'. Each request starts from a fresh state
(no prefix reuse).
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..backend import SerialBackend
from ..engine import Tokenizer
from ..runtime.sampling import TokenChooser, sampling_params
from ..errors import (
    BackendError,
    BackendUnavailableError,
    ConfigError,
    EdgeCloudError,
    InvalidRequestError,
    ModelIntegrityError,
    ModelNotFoundError,
)
from ..types import ChatCompletionChunk, ChatRequest, RouteInfo
from ..runtime.chunks import AnswerChunks, answer_budget

__all__ = ["COMPUTE_UNITS", "MIN_MACOS", "CoreMLBackend", "Step", "coreml_unavailable_reason", "stream_answer"]

#: Core ML states (the KV cache) need this macOS major version or later.
MIN_MACOS = 15
#: ``compute_units=`` names -> ``coremltools.ComputeUnit`` members.
COMPUTE_UNITS: dict[str, str] = {
    "all": "ALL",
    "cpu_and_ne": "CPU_AND_NE",
    "cpu_and_gpu": "CPU_AND_GPU",
    "cpu": "CPU_ONLY",
}

#: Scores ``new_tokens`` after ``filled`` cached positions; returns the last one's logits ``[vocab]``.
Step = Callable[[Sequence[int], int], np.ndarray]


def coreml_unavailable_reason() -> str | None:
    """Why Core ML cannot run predictions here, or ``None`` on macOS 15 or later."""
    advice = "the .mlpackage can be built here with `edgecloud export coreml` and copied to a Mac"
    if sys.platform != "darwin":
        return f"Core ML prediction needs macOS {MIN_MACOS}+ (this is {platform.system() or sys.platform}); {advice}"
    release = platform.mac_ver()[0]
    major = int(release.split(".")[0]) if release else 0
    if major < MIN_MACOS:
        return f"Core ML prediction needs macOS {MIN_MACOS}+ for stateful models (this is macOS {release}); upgrade macOS"
    return None


def stream_answer(
    step: Step, request: ChatRequest, prompt: Sequence[int], max_new_tokens: int, answer: AnswerChunks
) -> Iterator[ChatCompletionChunk]:
    """The chunks of ``answer``: prefill ``prompt`` (a failure comes before any chunk), then sample,
    push and step one token at a time until ``answer`` is done or ``max_new_tokens`` are out.

    The caller keeps ``len(prompt) + max_new_tokens`` within the model's context.
    """
    params = sampling_params(request, max_new_tokens)
    chooser = TokenChooser(params)
    logits = np.asarray(step(prompt, 0), dtype=np.float32)
    filled = len(prompt)
    yield answer.start()
    while answer.generated < max_new_tokens:
        token = chooser.pick(logits)
        yield from answer.push(token, logits)
        if answer.done:
            break
        if answer.generated < max_new_tokens:
            logits = np.asarray(step([token], filled), dtype=np.float32)
            filled += 1
    yield from answer.finish(len(prompt), 0)


class CoreMLBackend(SerialBackend):
    """A ``.mlpackage`` from ``edgecloud export coreml``, run by Core ML (macOS 15+), one request at a time.

    ``package`` is the package path; ``compute_units`` one of :data:`COMPUTE_UNITS` (``all``
    lets Core ML place ops on the Neural Engine, GPU and CPU). The context is the one the
    package was exported with. Constructing it anywhere but macOS 15+ raises
    :class:`~edgecloud.errors.BackendUnavailableError` saying so. Loading is lazy
    (:meth:`load` or the first request). Logprobs come from the package's float16 logits;
    presence / frequency penalties are refused.
    """

    name = "coreml"
    target = "edge"
    supports_logprobs = True
    supports_seed = True
    supports_stop = True

    def __init__(self, package: str | Path, *, compute_units: str = "all") -> None:
        reason = coreml_unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(reason)
        if compute_units not in COMPUTE_UNITS:
            raise ConfigError(f"unknown compute_units {compute_units!r}; use one of {', '.join(COMPUTE_UNITS)}")
        self.package = Path(package).expanduser()
        if not self.package.is_dir():
            raise ModelNotFoundError(
                f"no .mlpackage at {self.package}; build one with `edgecloud export coreml --model NAME --out X.mlpackage`"
            )
        self.compute_units = compute_units
        self.model_name = self.package.stem
        self.n_ctx = 0
        self.int4_block = 0
        self._model: Any = None
        self._tokenizer: Any = None
        super().__init__()

    @property
    def loaded(self) -> bool:
        """True once Core ML has loaded the package."""
        return self._model is not None

    def _ensure_loaded(self) -> tuple[Any, Any]:
        if self._model is not None:
            return self._model, self._tokenizer
        from ..runtime.coreml_package import FORMAT, import_coremltools, inspect_mlpackage, package_tokenizer

        ct = import_coremltools()
        metadata = inspect_mlpackage(self.package)["metadata"]
        if metadata.get("edgecloud.format") != FORMAT:
            raise ModelIntegrityError(
                f"{self.package} is not an edgecloud Core ML package of format {FORMAT} "
                f"(it says {metadata.get('edgecloud.format')!r}); export it again with `edgecloud export coreml`"
            )
        tokenizer = Tokenizer(package_tokenizer(self.package))
        try:
            units = ct.ComputeUnit[COMPUTE_UNITS[self.compute_units]]
            model = ct.models.MLModel(str(self.package), compute_units=units)
        except Exception as exc:  # noqa: BLE001 - Core ML reports load failures with several types
            tokenizer.close()
            raise BackendUnavailableError(f"Core ML could not load {self.package}: {exc}") from exc
        self.n_ctx = int(metadata["edgecloud.context"])
        self.int4_block = int(metadata["edgecloud.int4_block"])
        self.model_name = metadata.get("edgecloud.model", self.model_name)
        self._model, self._tokenizer = model, tokenizer
        return model, tokenizer

    def _free(self) -> None:
        tokenizer, self._tokenizer = self._tokenizer, None
        self._model = None
        if tokenizer is not None:
            tokenizer.close()

    def stream(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        """Yield the answer as OpenAI-shaped chunks; closing the iterator stops generation."""
        return self._generate(request)

    def _route(self) -> RouteInfo:
        reason = f"on Core ML ({self.compute_units}), INT4 weights (block {self.int4_block})"
        return RouteInfo(target="edge", backend=self.name, reason=reason)

    def _step(self, model: Any) -> Step:
        """One ``predict`` per call, on a state of its own (a fresh KV cache)."""
        from ..runtime.coreml_package import causal_mask

        state = model.make_state()

        def step(tokens: Sequence[int], filled: int) -> np.ndarray:
            n = len(tokens)
            inputs = {"input_ids": np.asarray([tokens], dtype=np.int32), "causal_mask": causal_mask(n, filled + n)}
            return model.predict(inputs, state=state)["logits"][0, -1]

        return step

    def _generate(self, request: ChatRequest) -> Iterator[ChatCompletionChunk]:
        for field, value in (("presence_penalty", request.presence_penalty),
                             ("frequency_penalty", request.frequency_penalty)):
            if value:
                raise InvalidRequestError(f"{field} is not supported by the Core ML backend", param=field)
        with self._serving():
            model, tokenizer = self._ensure_loaded()
            prompt = tokenizer.encode_request(request)
            max_new = answer_budget(
                len(prompt), self.n_ctx, request.max_tokens,
                " (the package's --context, with 1 token of room for the answer)",
            )
            answer = AnswerChunks(
                request, self.model_name, self._route(), lambda t: tokenizer.token_to_piece(t, special=False),
                tokenizer.is_eog,
            )
            try:
                yield from stream_answer(self._step(model), request, prompt, max_new, answer)
            except (GeneratorExit, EdgeCloudError):
                raise
            except Exception as exc:
                raise BackendError(f"Core ML failed while generating: {exc}") from exc
