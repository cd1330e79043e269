"""Exporting a GGUF model to an ONNX Runtime GenAI folder with INT4 (MatMulNBits) weights.

This module owns :func:`export_onnx` and its four stages, each a function named after what
it does:

1. :func:`write_hf_checkpoint` (*dequantize*): every GGUF tensor dequantized to float32 with
   the engine's bit-exact decoders (:class:`~edgecloud.engine.GGUFFile`), renamed to
   its Hugging Face name and written as sharded safetensors; llama-family Q/K rows are
   un-permuted (llama.cpp's converter permutes them for its rope; Hugging Face's rotate-half
   rope wants them back). The ``config.json`` (:func:`hf_config`, from the GGUF metadata) is
   written once the next stage knows the end-of-generation ids.
2. :func:`write_tokenizer` (*tokenizer*): ``tokenizer.json`` built by transformers from the
   GGUF vocabulary and merges (offline; token ids match llama.cpp's, tested).
3. :func:`build_genai_model` (*build*): the onnxruntime-genai model builder, run in-process
   on that folder with ``-p int4 -e cpu``, MatMulNBits block size 32 (by default) and
   :data:`BUILDER_OPTIONS`; its ``Reading layer N`` and quantization lines drive the progress
   display and its output is kept for errors.
4. :func:`verify_export` (*verify*): the folder is loaded with onnxruntime-genai and a few
   greedy tokens are generated.

Why the project's own dequantizer rather than transformers' ``gguf_file=`` loading: it is the
same arithmetic (bit-identical to gguf-py) but multi-threaded torch and chunked, where
transformers goes through ``gguf.GGUFReader`` (seconds just to open a Qwen file) and numpy;
and the tensor names it must produce are a short table here, next to the model code that
already loads the same tensors by their llama.cpp names.

The export folder also holds ``edgecloud.json`` (:class:`~edgecloud.edge.onnx.ExportManifest`):
the source model, the GGUF's chat template and special-token strings, and llama.cpp's
end-of-generation ids, so :class:`~edgecloud.edge.onnx.OnnxBackend` formats prompts exactly
like the llama.cpp backend without the GGUF file being present.

Bad input: a non-empty ``out`` is refused unless ``force``; a GGUF architecture without a
mapping here, or a Hugging Face architecture the builder does not know, raises
:class:`~edgecloud.errors.BackendUnavailableError` naming it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime.chat_template import CHATML_TEMPLATE
from ..store.onnx_manifest import EXPORT_FILE, ExportManifest, load_manifest
from ..errors import BackendError, BackendUnavailableError, EdgeCloudError, InvalidRequestError

__all__ = [
    "BLOCK_SIZES",
    "BUILDER_OPTIONS",
    "HF_ARCHITECTURES",
    "STAGES",
    "ExportResult",
    "HFArchitecture",
    "SpecialTokens",
    "build_genai_model",
    "cached_export",
    "end_of_generation_ids",
    "export_onnx",
    "hf_config",
    "hf_tensor_name",
    "write_hf_checkpoint",
    "write_tokenizer",
    "verify_export",
]

#: The stages :func:`export_onnx` reports progress for, in order.
STAGES = ("dequantize", "tokenizer", "build", "verify")
#: MatMulNBits block sizes the builder accepts.
BLOCK_SIZES = (16, 32, 64, 128, 256)
#: Builder options besides the block size. The embedding table is INT4 too (GatherBlockQuantized):
#: in float32 it would be most of a small model (545 MB of the 0.5B's 822 MB). The LM head
#: scores only the last prompt position (a prompt's logits would be prompt x vocab floats).
BUILDER_OPTIONS = ("op_types_to_quantize=MatMul/Gather", "prune_lm_head=true", "hf_token=false")
#: Safetensors shard size: bounds the float32 tensors held in memory while dequantizing.
SHARD_BYTES = 1 << 30
#: Tokens :func:`verify_export` generates.
VERIFY_TOKENS = 8
#: Token texts llama.cpp treats as end of generation besides the eos/eot/eom ids
#: (``llama_vocab::impl::load`` in llama-vocab.cpp), for when llama.cpp itself is not installed;
#: gives llama.cpp's own ids for the catalogue's SmolLM2 and Qwen2.5 files.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "_<EOT>",
    "<｜end▁of▁sentence｜>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<fim-pad>", "<reponame>", "</s>",
})

#: (stage, done, total): how far a stage is; ``total`` 0 means not measurable.
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class HFArchitecture:
    """How a GGUF architecture is written as a Hugging Face checkpoint."""

    architecture: str
    model_type: str
    #: llama.cpp permuted the Q/K rows of this family for its "normal" rope.
    permuted_qk: bool


#: GGUF ``general.architecture`` -> Hugging Face checkpoint; the families the engine's model code runs.
HF_ARCHITECTURES: dict[str, HFArchitecture] = {
    "llama": HFArchitecture("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen2": HFArchitecture("Qwen2ForCausalLM", "qwen2", permuted_qk=False),
}

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
#: Tensors with no Hugging Face counterpart (rope frequencies are recomputed from the config).
_SKIPPED = frozenset({"rope_freqs.weight"})


@dataclass
class ExportResult:
    """What :func:`export_onnx` built, how big it is and how long each stage took."""

    out: Path
    manifest: ExportManifest
    onnx_bytes: int
    seconds: dict[str, float] = field(default_factory=dict)
    sample: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (what ``edgecloud export onnx --json`` prints)."""
        return {
            "out": str(self.out),
            "model": self.manifest.model,
            "architecture": self.manifest.architecture,
            "precision": self.manifest.precision,
            "block_size": self.manifest.block_size,
            "onnx_bytes": self.onnx_bytes,
            "seconds": {k: round(v, 2) for k, v in self.seconds.items()},
            "total_seconds": round(sum(self.seconds.values()), 2),
            "sample": self.sample,
        }


def hf_architecture(arch: str) -> HFArchitecture:
    """The Hugging Face mapping for GGUF architecture ``arch``; BackendUnavailableError naming it otherwise."""
    if arch not in HF_ARCHITECTURES:
        supported = ", ".join(sorted(HF_ARCHITECTURES))
        raise BackendUnavailableError(
            f"the ONNX export does not support architecture {arch!r} (supported: {supported}); "
            "run this model with the llama.cpp backend instead"
        )
    return HF_ARCHITECTURES[arch]


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None for tensors the checkpoint does not keep)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    if gguf_name in _SKIPPED:
        return None
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise BackendUnavailableError(f"the ONNX export has no Hugging Face name for GGUF tensor {gguf_name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def unpermute_qk(values: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (``convert_hf_to_gguf.LlamaModel.permute``) for ``n_head`` heads."""
    # the converter turned each head's rows from (2, half) order into (half, 2) order; turn them back
    rows = values.shape[0]
    return (
        values.reshape(n_head, rows // n_head // 2, 2, *values.shape[1:])
        .swapaxes(1, 2)
        .reshape(values.shape)
    )


@dataclass(frozen=True)
class SpecialTokens:
    """The special-token strings a chat template renders, and the ids generation ends at."""

    bos_token: str
    eos_token: str
    eog_token_ids: list[int]


def end_of_generation_ids(gguf_path: Path, metadata: dict[str, Any], vocab: dict[str, int]) -> list[int]:
    """Token ids llama.cpp stops at for this file: asked of llama.cpp itself when it is installed,
    otherwise the metadata's eos/eot/eom ids and the end-of-turn tokens llama.cpp knows by text."""
    try:
        from ..engine import Tokenizer

        tokenizer = Tokenizer(gguf_path)
    except (ImportError, BackendUnavailableError):
        ids = {vocab[text] for text in _EOG_TEXTS if text in vocab}
        for key in ("eos", "eot", "eom"):
            if (value := metadata.get(f"tokenizer.ggml.{key}_token_id")) is not None:
                ids.add(int(value))
        return sorted(ids)
    try:
        return sorted(tokenizer.eog_ids)
    finally:
        tokenizer.close()


def hf_config(
    metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]], eog_ids: list[int] | None = None
) -> dict[str, Any]:
    """A Hugging Face ``config.json`` for the GGUF model described by ``metadata`` and its tensor table;
    ``eog_ids`` (default: the metadata's eos id) become ``eos_token_id``, where onnxruntime-genai stops."""
    from ..engine import ModelArgs

    arch = str(metadata.get("general.architecture", ""))
    target = hf_architecture(arch)
    args = ModelArgs.from_gguf(metadata, tensor_shapes)
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    config: dict[str, Any] = {
        "architectures": [target.architecture],
        "model_type": target.model_type,
        "hidden_size": args.n_embd,
        "intermediate_size": args.n_ff,
        "num_hidden_layers": args.n_layer,
        "num_attention_heads": args.n_head,
        "num_key_value_heads": args.n_head_kv,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.context_length,
        "rms_norm_eps": args.rms_eps,
        "rope_theta": args.rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": args.tied_embeddings,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eog_ids or eos,
        "torch_dtype": "float32",
    }
    if args.rope_freq_scale != 1.0:
        config["rope_scaling"] = {"rope_type": "linear", "factor": 1.0 / args.rope_freq_scale}
    if target.model_type == "llama":
        config["attention_bias"] = args.attn_bias
        config["mlp_bias"] = False
    else:
        config["use_sliding_window"] = False
        config["max_window_layers"] = args.n_layer
    return config


def write_hf_checkpoint(gguf_path: Path, folder: Path, progress: Progress | None = None) -> dict[str, Any]:
    """Dequantize ``gguf_path`` into ``folder`` as Hugging Face safetensors; returns the ``config.json``
    contents (written by the caller once the end-of-generation ids are known).

    Tensors go to float32 shards of about :data:`SHARD_BYTES` (with the index transformers
    reads), so memory stays bounded by one shard whatever the model size.
    """
    from safetensors.numpy import save_file

    from ..engine import GGUFFile

    gguf = GGUFFile(gguf_path)
    target = hf_architecture(gguf.arch)
    shapes = {name: info.shape for name, info in gguf.tensors.items()}
    config = hf_config(gguf.metadata, shapes)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    folder.mkdir(parents=True, exist_ok=True)
    total = sum(info.nbytes for info in gguf.tensors.values())
    done = 0
    shards: list[dict[str, np.ndarray]] = [{}]
    shard_bytes = 0
    weight_map: dict[str, int] = {}

    for name, values in gguf.iter_tensors():
        done += gguf.tensors[name].nbytes
        hf_name = hf_tensor_name(name)
        if hf_name is not None:
            part = name.split(".")[2] if name.startswith("blk.") else ""
            if target.permuted_qk and part in heads:
                values = unpermute_qk(values, heads[part])
            if shard_bytes + values.nbytes > SHARD_BYTES and shards[-1]:
                _save_shard(save_file, folder, len(shards) - 1, shards[-1])
                shards.append({})
                shard_bytes = 0
            shards[-1][hf_name] = np.ascontiguousarray(values)
            shard_bytes += values.nbytes
            weight_map[hf_name] = len(shards) - 1
        if progress is not None:
            progress("dequantize", done, total)
    _save_shard(save_file, folder, len(shards) - 1, shards[-1])
    count = len(shards)
    names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    for i in range(count):
        (folder / f"shard-{i}.safetensors").rename(folder / names[i])
    index = {"metadata": {}, "weight_map": {k: names[i] for k, i in sorted(weight_map.items())}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1), encoding="utf-8")
    return config


def _save_shard(save_file: Callable[..., None], folder: Path, i: int, tensors: dict[str, np.ndarray]) -> None:
    save_file(tensors, str(folder / f"shard-{i}.safetensors"), metadata={"format": "pt"})
    tensors.clear()


def write_tokenizer(gguf_path: Path, folder: Path) -> SpecialTokens:
    """Write ``tokenizer.json`` (and its config) for ``gguf_path`` into ``folder``, built by transformers
    from the file's own vocabulary and merges (no hub access); returns the special tokens.

    Only byte-level BPE vocabularies (``tokenizer.ggml.model = gpt2``) are exported: their
    token pieces map to bytes exactly, which the ONNX backend's streaming relies on.
    """
    from ..runtime.gguf import read_gguf_header

    metadata = read_gguf_header(gguf_path).metadata
    kind = str(metadata.get("tokenizer.ggml.model", ""))
    if kind != "gpt2":
        raise BackendUnavailableError(
            f"the ONNX export supports byte-level BPE vocabularies (tokenizer model 'gpt2'), not {kind!r}; "
            "run this model with the llama.cpp backend instead"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (OSError, ValueError, KeyError) as exc:
        raise BackendUnavailableError(f"transformers could not build a tokenizer from {gguf_path}: {exc}") from exc
    tokenizer.save_pretrained(str(folder))
    vocab: dict[str, int] = tokenizer.get_vocab()
    text_of = {i: t for t, i in vocab.items()}

    def text(key: str) -> str:
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return text_of.get(int(token_id), "") if token_id is not None else ""

    return SpecialTokens(text("bos"), text("eos"), end_of_generation_ids(gguf_path, metadata, vocab))


class _BuilderLog(io.TextIOBase):
    """Collects the builder's printed and logged lines, and turns them into build progress:
    one step per ``Reading ...`` line (embedding, each layer, final norm, LM head), then one per
    quantized MatMul (about five a layer, plus the LM head)."""

    _READING = re.compile(r"Reading (layer (\d+)|embedding layer|final norm|LM head)")
    _QUANTIZED = re.compile(r"complete quantization of ")

    def __init__(self, n_layer: int, progress: Progress | None) -> None:
        self.lines: list[str] = []
        self._partial = ""
        self._n_layer = n_layer
        self._progress = progress
        self._quantized = 0
        self._reading_steps = n_layer + 3
        self.steps = self._reading_steps + 5 * n_layer + 1

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._partial += text
        *complete, self._partial = re.split(r"[\r\n]", self._partial)
        for line in complete:
            if line.strip():
                self.lines.append(line)
                self._advance(line)
        return len(text)

    def _advance(self, line: str) -> None:
        if self._progress is None:
            return
        if self._QUANTIZED.search(line):
            self._quantized += 1
            self._progress("build", min(self._reading_steps + self._quantized, self.steps - 1), self.steps)
            return
        match = self._READING.search(line)
        if match is None:
            return
        if match.group(2) is not None:
            step = int(match.group(2)) + 2
        else:
            step = {"embedding layer": 1, "final norm": self._n_layer + 2, "LM head": self._n_layer + 3}[match.group(1)]
        self._progress("build", step, self.steps)

    def tail(self, n: int = 12) -> str:
        return "\n".join(self.lines[-n:])


@contextlib.contextmanager
def _captured(log: _BuilderLog) -> Iterator[None]:
    """Send the builder's prints and onnxruntime's log records to ``log``.

    onnxruntime's quantizer calls ``logging.basicConfig(level=INFO)`` when it is imported;
    the root logger's handlers and level are put back afterwards so that does not leak.
    """
    root = logging.getLogger()
    root_handlers, root_level = root.handlers[:], root.level
    ort = logging.getLogger("onnxruntime")
    handler = logging.StreamHandler(log)
    ort.addHandler(handler)
    ort.propagate = False
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            yield
    finally:
        ort.removeHandler(handler)
        ort.propagate = True
        root.handlers[:] = root_handlers
        root.setLevel(root_level)


def build_genai_model(
    hf_folder: Path,
    out: Path,
    *,
    block_size: int = 32,
    cache_dir: Path | None = None,
    progress: Progress | None = None,
) -> None:
    """Run the onnxruntime-genai model builder on a Hugging Face folder: INT4 MatMulNBits for the CPU.

    Runs in-process (typed errors, no second copy of torch in memory) with its prints
    captured. An architecture the builder does not know raises BackendUnavailableError naming
    it; any other builder failure raises BackendError with the end of its output.
    """
    _check_block_size(block_size)
    config = json.loads((hf_folder / "config.json").read_text(encoding="utf-8"))
    architecture = (config.get("architectures") or ["(none)"])[0]
    log = _BuilderLog(int(config.get("num_hidden_layers", 0)), progress)
    options = [f"block_size={block_size}", *BUILDER_OPTIONS]
    args = (None, str(hf_folder), str(out), "int4", "cpu", str(cache_dir or hf_folder / "cache"))
    try:
        with _captured(log):  # importing the builder imports onnxruntime's quantizer (see _captured)
            try:
                from onnxruntime_genai.models import builder
            except ImportError as exc:
                raise BackendUnavailableError(
                    f"the onnxruntime-genai model builder cannot be imported ({exc}); "
                    "run: pip install 'edgecloud[onnx]'"
                ) from exc
            extra = builder.parse_extra_options(*args, options)
            builder.create_model(*args, **extra)
    except NotImplementedError as exc:
        raise BackendUnavailableError(
            f"the onnxruntime-genai builder does not support architecture {architecture!r}; "
            "run this model with the llama.cpp backend instead"
        ) from exc
    except EdgeCloudError:
        raise
    except Exception as exc:
        raise BackendError(f"the onnxruntime-genai builder failed on {architecture}: {exc}\n{log.tail()}") from exc
    if progress is not None:
        progress("build", log.steps, log.steps)


def verify_export(out: Path, *, tokens: int = VERIFY_TOKENS) -> str:
    """Load ``out`` with onnxruntime-genai and generate ``tokens`` greedy tokens; returns their text."""
    from ..edge.onnx import OnnxBackend
    from ..types import ChatRequest

    request = ChatRequest(messages=[{"role": "user", "content": "Say hello."}], temperature=0, max_tokens=tokens)
    with OnnxBackend(out, n_threads=1) as backend:
        completion = backend.complete(request)
    if completion.usage is None or completion.usage.completion_tokens == 0:
        raise BackendUnavailableError(f"the exported model in {out} loaded but generated nothing")
    return completion.text


def _check_block_size(block_size: int) -> None:
    if block_size not in BLOCK_SIZES:
        raise InvalidRequestError(
            f"block_size must be one of {', '.join(map(str, BLOCK_SIZES))}, got {block_size}", param="block_size"
        )


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise InvalidRequestError(f"--out {out} is a file; give a folder path", param="out")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise InvalidRequestError(
                f"--out {out} exists and is not empty; choose a new folder or pass --force to replace it",
                param="out",
            )
        shutil.rmtree(out)


@contextlib.contextmanager
def _timed(seconds: dict[str, float], stage: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[stage] = time.perf_counter() - start


def export_onnx(
    model: str | Path,
    out: str | Path,
    *,
    force: bool = False,
    block_size: int = 32,
    verify: bool = True,
    progress: Progress | None = None,
) -> ExportResult:
    """Export ``model`` (a catalogue name or a ``.gguf`` path) into ``out`` as an INT4 ONNX Runtime GenAI folder.

    Stages (reported through ``progress``): dequantize, tokenizer, build, verify. The
    intermediate float32 checkpoint lives in a temporary folder next to ``out`` and is
    removed afterwards; a failed build leaves ``out`` empty, never half-written.
    """
    from ..runtime.gguf import read_gguf_header
    from ..store import resolve_model

    out = Path(out).expanduser()
    _check_block_size(block_size)
    _check_out(out, force)
    gguf_path = resolve_model(model, pull=True, progress=progress is None)
    metadata = read_gguf_header(gguf_path).metadata
    hf_architecture(str(metadata.get("general.architecture", "")))  # fail before any work
    seconds: dict[str, float] = {}
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".edgecloud-hf-", dir=out.parent) as tmp:
        hf_folder = Path(tmp) / "hf"
        try:
            with _timed(seconds, "dequantize"):
                config = write_hf_checkpoint(gguf_path, hf_folder, progress)
            with _timed(seconds, "tokenizer"):
                special = write_tokenizer(gguf_path, hf_folder)
                config["eos_token_id"] = special.eog_token_ids
                (hf_folder / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
                _report(progress, "tokenizer")
            with _timed(seconds, "build"):
                build_genai_model(hf_folder, out, block_size=block_size, cache_dir=Path(tmp) / "cache", progress=progress)
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            raise
    manifest = ExportManifest(
        model=Path(model).stem if str(model).endswith(".gguf") else str(model),
        source_path=str(gguf_path),
        source_bytes=gguf_path.stat().st_size,
        architecture=str(metadata.get("general.architecture")),
        block_size=block_size,
        chat_template=metadata.get("tokenizer.chat_template") or CHATML_TEMPLATE,
        bos_token=special.bos_token,
        eos_token=special.eos_token,
        eog_token_ids=special.eog_token_ids,
        context_length=int(config["max_position_embeddings"]),
    )
    (out / EXPORT_FILE).write_text(manifest.model_dump_json(indent=1), encoding="utf-8")
    result = ExportResult(out=out, manifest=load_manifest(out), onnx_bytes=_onnx_bytes(out), seconds=seconds)
    if verify:
        with _timed(seconds, "verify"):
            result.sample = verify_export(out)
            _report(progress, "verify")
    return result


def cached_export(model: str | Path, root: Path, *, block_size: int = 32, progress: Progress | None = None) -> Path:
    """An export of ``model`` under ``root``, built on first use and reused while its source is unchanged.

    The folder name carries what the export depends on: the GGUF file's name, size and mtime,
    the block size, a digest of :data:`BUILDER_OPTIONS`, and the onnxruntime-genai version (its
    builder writes the graph). Builds
    are serialized by a lock file, so concurrent callers build once.
    """
    import onnxruntime_genai

    from ..store import resolve_model
    from ..store.cache import exclusive_lock

    gguf_path = resolve_model(model, pull=True, progress=False)
    st = gguf_path.stat()
    options = hashlib.sha256("\n".join(BUILDER_OPTIONS).encode()).hexdigest()[:8]
    key = f"{gguf_path.stem}-{st.st_size}-{st.st_mtime_ns}-b{block_size}-{options}-og{onnxruntime_genai.__version__}"
    folder = root / key
    root.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(root / f".{key}.lock"):
        if not (folder / EXPORT_FILE).is_file():
            export_onnx(gguf_path, folder, force=True, block_size=block_size, progress=progress)
    return folder


def _report(progress: Progress | None, stage: str) -> None:
    if progress is not None:
        progress(stage, 1, 1)


def _onnx_bytes(out: Path) -> int:
    """Bytes of the ONNX graph and its external weights."""
    return sum(p.stat().st_size for p in out.iterdir() if p.is_file() and (p.suffix == ".onnx" or p.name.endswith(".onnx.data")))
