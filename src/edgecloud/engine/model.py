"""A compact transformer for the llama and qwen2 families, with an explicit per-sequence KV cache.

This module owns :class:`ModelArgs` (built from GGUF metadata), :class:`KVCache` (one per
sequence, preallocated ``[n_layer, max_tokens, n_head_kv, head_dim]`` K and V tensors) and
:class:`Transformer`, whose ``forward(tokens[T], positions[T], cache) -> logits[T, vocab]``
scores any number of new positions at once (prefill, one decode step, or the k+1 positions a
speculative verifier checks). :meth:`Transformer.forward_batch` runs several sequences in
one pass: their tokens are concatenated for every matmul and only attention is per sequence,
which is what a continuous-batching scheduler needs.

Modules are named after llama.cpp's tensor names (``token_embd``, ``blk.N.attn_q``,
``ffn_gate``, ``output_norm``, ``output``) so a GGUF file's tensors load by name.

RoPE follows llama.cpp per architecture instead of un-permuting weights: llama.cpp's
converter permutes the Q/K rows of llama-family models so that its "normal" rope (rotating
adjacent pairs ``(x[2i], x[2i+1])``) reproduces the Hugging Face rotate-half result, while
qwen2 keeps the HF layout and llama.cpp uses NEOX rope (pairs ``(x[i], x[i + n_rot/2])``).
Using the same rope on the same tensors gives the same numbers as llama.cpp.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import BackendUnavailableError, ContextOverflowError, InvalidRequestError, ModelIntegrityError

__all__ = ["DEFAULT_N_CTX", "PRECISIONS", "ROPE_STYLES", "KVCache", "ModelArgs", "Transformer", "apply_rope", "param_bytes"]

#: llama.cpp's rope type per GGUF architecture (``llama_model_rope_type`` in llama-model.cpp).
ROPE_STYLES: dict[str, str] = {"llama": "normal", "qwen2": "neox"}
#: ``from_gguf(precision=...)`` -> load dtype (``None``: keep ``dtype``; fp8 converts the block linears after loading).
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": None}

#: Context served when neither ``n_ctx`` nor a smaller model limit says otherwise.
DEFAULT_N_CTX = 4096


@dataclass
class ModelArgs:
    """Shape and numerics of one model; ``from_gguf`` reads them from GGUF metadata."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    vocab_size: int
    context_length: int = 4096
    head_dim: int = 0
    rope_dim: int = 0
    rope_theta: float = 10000.0
    rope_freq_scale: float = 1.0
    rms_eps: float = 1e-5
    attn_bias: bool = False
    tied_embeddings: bool = False
    rope_style: str = ""

    def __post_init__(self) -> None:
        if not self.rope_style:
            if self.arch not in ROPE_STYLES:
                supported = ", ".join(sorted(ROPE_STYLES))
                raise BackendUnavailableError(
                    f"the torch engine does not support architecture {self.arch!r} (supported: {supported}); "
                    "serve this model with llama.cpp or vLLM"
                )
            self.rope_style = ROPE_STYLES[self.arch]
        if self.head_dim <= 0:
            self.head_dim = self.n_embd // self.n_head
        if self.rope_dim <= 0:
            self.rope_dim = self.head_dim
        if self.n_head % self.n_head_kv:
            raise ModelIntegrityError(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> ModelArgs:
        """From GGUF key/values (``{arch}.block_count``, ...) and the tensor table (for vocab, bias, tying)."""
        arch = str(metadata.get("general.architecture", ""))

        def key(suffix: str, default: Any = None) -> Any:
            value = metadata.get(f"{arch}.{suffix}", default)
            if value is None:
                raise ModelIntegrityError(f"GGUF metadata lacks {arch}.{suffix}")
            return max(value) if isinstance(value, list) else value

        scaling = str(metadata.get(f"{arch}.rope.scaling.type", "none"))
        if scaling not in ("none", "linear"):
            raise BackendUnavailableError(f"the torch engine does not implement {scaling!r} rope scaling")
        factor = float(metadata.get(f"{arch}.rope.scaling.factor", 0.0) or 0.0)
        if "token_embd.weight" not in tensor_shapes:
            raise ModelIntegrityError("GGUF file has no token_embd.weight tensor")
        n_embd, n_head = int(key("embedding_length")), int(key("attention.head_count"))
        return cls(
            arch=arch,
            n_layer=int(key("block_count")),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=int(key("attention.head_count_kv", n_head)),
            n_ff=int(key("feed_forward_length")),
            vocab_size=int(tensor_shapes["token_embd.weight"][0]),
            context_length=int(key("context_length", 4096)),
            head_dim=int(key("attention.key_length", n_embd // n_head)),
            rope_dim=int(key("rope.dimension_count", 0)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_freq_scale=1.0 / factor if scaling == "linear" and factor > 0 else 1.0,
            rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            attn_bias="blk.0.attn_q.bias" in tensor_shapes,
            tied_embeddings="output.weight" not in tensor_shapes,
        )


class KVCache:
    """Keys and values of one sequence: slot ``p`` holds position ``p``; ``length`` slots are valid.

    Slots past ``length`` may hold stale values (a rejected speculative draft); they are never
    read, because a forward only attends to slots ``<= `` each query's position and writes
    its own positions first. :meth:`truncate` is therefore O(1).
    """

    def __init__(self, k: Tensor, v: Tensor) -> None:
        self.k = k
        self.v = v
        self.length = 0

    @classmethod
    def allocate(
        cls, args: ModelArgs, max_tokens: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> KVCache:
        """An empty cache for up to ``max_tokens`` positions (slots are uninitialised: never read before written)."""
        shape = (args.n_layer, max_tokens, args.n_head_kv, args.head_dim)
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))

    @property
    def max_tokens(self) -> int:
        """Positions this cache can hold."""
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        """Memory held by K and V."""
        return self.k.numel() * self.k.element_size() * 2

    def truncate(self, length: int) -> None:
        """Forget every position ``>= length`` (rejected draft tokens, a rewound turn)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 as llama.cpp does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, style: str) -> Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` dims of ``x[T, H, D]`` the way llama.cpp does for ``style``."""
    half = cos.shape[-1]
    n_rot = 2 * half
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :n_rot].float(), x[..., n_rot:]
    if style == "neox":
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        pairs = rot.unflatten(-1, (half, 2))
        x1, x2 = pairs[..., 0], pairs[..., 1]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    out = out.to(x.dtype)
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


class Block(nn.Module):
    """One layer: pre-norm GQA attention over the KV cache, then a pre-norm SwiGLU MLP, both residual."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        q_dim, kv_dim = args.n_head * args.head_dim, args.n_head_kv * args.head_dim
        self.attn_norm = RMSNorm(args.n_embd, args.rms_eps)
        self.attn_q = nn.Linear(args.n_embd, q_dim, bias=args.attn_bias)
        self.attn_k = nn.Linear(args.n_embd, kv_dim, bias=args.attn_bias)
        self.attn_v = nn.Linear(args.n_embd, kv_dim, bias=args.attn_bias)
        self.attn_output = nn.Linear(q_dim, args.n_embd, bias=False)
        self.ffn_norm = RMSNorm(args.n_embd, args.rms_eps)
        self.ffn_gate = nn.Linear(args.n_embd, args.n_ff, bias=False)
        self.ffn_up = nn.Linear(args.n_embd, args.n_ff, bias=False)
        self.ffn_down = nn.Linear(args.n_ff, args.n_embd, bias=False)
        #: Set by :meth:`fuse` (then the separate projections are gone).
        self.attn_qkv: nn.Module | None = None
        self.ffn_gate_up: nn.Module | None = None

    def fuse(self) -> bool:
        """Replace q/k/v by one ``attn_qkv`` and gate/up by one ``ffn_gate_up`` (plain ``nn.Linear``
        only); True when fused. Same numbers, fewer matmuls (:func:`~edgecloud.engine.fuse_projections`)."""
        from .linear import fused_linear

        parts = ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")
        if self.attn_qkv is not None or not all(type(self._modules.get(n)) is nn.Linear for n in parts):
            return False
        self.attn_qkv = fused_linear([self.attn_q, self.attn_k, self.attn_v])
        self.ffn_gate_up = fused_linear([self.ffn_gate, self.ffn_up])
        for name in parts:
            delattr(self, name)
        return True

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, segments: Sequence[_Segment]) -> Tensor:
        x = x + self.attention(self.attn_norm(x), cos, sin, layer, segments)
        h = self.ffn_norm(x)
        if self.ffn_gate_up is not None:
            gate, up = self.ffn_gate_up(h).chunk(2, dim=-1)
        else:
            gate, up = self.ffn_gate(h), self.ffn_up(h)
        return x + self.ffn_down(F.silu(gate) * up)

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, segments: Sequence[_Segment]) -> Tensor:
        """Project, rotate, write this layer's K/V into each sequence's cache, attend per sequence."""
        a = self.args
        T = x.shape[0]
        if self.attn_qkv is not None:
            q, k, v = self.attn_qkv(x).split([a.n_head * a.head_dim, a.n_head_kv * a.head_dim,
                                              a.n_head_kv * a.head_dim], dim=-1)
        else:
            q, k, v = self.attn_q(x), self.attn_k(x), self.attn_v(x)
        q = apply_rope(q.reshape(T, a.n_head, a.head_dim), cos, sin, a.rope_style)
        k = apply_rope(k.reshape(T, a.n_head_kv, a.head_dim), cos, sin, a.rope_style)
        v = v.reshape(T, a.n_head_kv, a.head_dim)
        group = a.n_head // a.n_head_kv
        if len(segments) > 1 and T == len(segments):
            return self.attn_output(self._decode_attention(q, k, v, layer, segments))
        outs = []
        for seg in segments:
            rows = slice(seg.start, seg.end)
            seg.cache.k[layer, seg.first : seg.stop] = k[rows]
            seg.cache.v[layer, seg.first : seg.stop] = v[rows]
            # [1, heads, positions, head_dim]: the 4-D layout the fused CPU/GPU SDPA kernels take
            keys = seg.cache.k[layer, : seg.stop].transpose(0, 1).unsqueeze(0)
            values = seg.cache.v[layer, : seg.stop].transpose(0, 1).unsqueeze(0)
            n = seg.end - seg.start
            if n == 1:
                # one query (a decode step) needs no mask: the group's query heads become rows of
                # one query per kv head, so no kv is repeated
                out = F.scaled_dot_product_attention(q[rows].view(1, a.n_head_kv, group, a.head_dim), keys, values)
            else:
                out = F.scaled_dot_product_attention(
                    q[rows].transpose(0, 1).unsqueeze(0), keys, values, attn_mask=seg.mask, enable_gqa=group > 1
                )[0].transpose(0, 1)
            outs.append(out.reshape(n, a.n_head * a.head_dim))
        return self.attn_output(outs[0] if len(outs) == 1 else torch.cat(outs))

    def _decode_attention(self, q: Tensor, k: Tensor, v: Tensor, layer: int, segments: Sequence[_Segment]) -> Tensor:
        """One decode token for each of several sequences, attended in one kernel call.

        Each sequence's keys and values are copied into one zero-padded ``[B, kv heads, L, D]``
        pair, masked past its own length; a copy costs a few microseconds against tens for a
        kernel call per sequence, which at 8 sequences was an eighth of a step.
        """
        a = self.args
        B = len(segments)
        if segments[0].scratch is None:  # the step's first layer: buffers and mask for all its layers
            longest = max(seg.stop for seg in segments)
            stops = torch.tensor([seg.stop for seg in segments], device=q.device)
            mask = (torch.arange(longest, device=q.device)[None, :] < stops[:, None])[:, None, None, :]
            segments[0].scratch = (k.new_zeros(B, longest, a.n_head_kv, a.head_dim),
                                   k.new_zeros(B, longest, a.n_head_kv, a.head_dim), mask)
        keys, values, mask = segments[0].scratch
        for i, seg in enumerate(segments):
            seg.cache.k[layer, seg.first] = k[i]
            seg.cache.v[layer, seg.first] = v[i]
            keys[i, : seg.stop] = seg.cache.k[layer, : seg.stop]
            values[i, : seg.stop] = seg.cache.v[layer, : seg.stop]
        group = a.n_head // a.n_head_kv
        out = F.scaled_dot_product_attention(q.view(B, a.n_head_kv, group, a.head_dim), keys.transpose(1, 2),
                                             values.transpose(1, 2), attn_mask=mask)
        return out.reshape(B, a.n_head * a.head_dim)


@dataclass
class _Segment:
    """One sequence's rows ``[start, end)`` of a flattened batch, writing cache slots from ``first``."""

    start: int
    end: int
    first: int
    cache: KVCache
    mask: Tensor | None
    #: Zero-padded keys and values of a decode step and their length mask, shared by its layers
    #: (on the first segment).
    scratch: tuple[Tensor, Tensor, Tensor] | None = None

    @property
    def stop(self) -> int:
        return self.first + self.end - self.start


class Transformer(nn.Module):
    """The llama/qwen2 decoder; ``forward`` scores new positions of one sequence against its cache."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.token_embd = nn.Embedding(args.vocab_size, args.n_embd)
        self.blk = nn.ModuleList(Block(args) for _ in range(args.n_layer))
        self.output_norm = RMSNorm(args.n_embd, args.rms_eps)
        self.output = nn.Linear(args.n_embd, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", self._inv_freq(None), persistent=False)
        #: Seconds :meth:`from_gguf` took (header, dequantization, assembly).
        self.load_seconds = 0.0

    def _inv_freq(self, freq_factors: Tensor | None) -> Tensor:
        a = self.args
        exponents = torch.arange(0, a.rope_dim, 2, dtype=torch.float64) / a.rope_dim
        inv = a.rope_freq_scale / a.rope_theta**exponents
        if freq_factors is not None:  # llama 3.x long-context factors divide the frequencies
            inv = inv / freq_factors.to(torch.float64)
        return inv

    @property
    def dtype(self) -> torch.dtype:
        """Activation dtype: that of the embeddings (and of the KV cache :meth:`new_cache` allocates)."""
        return self.token_embd.weight.dtype

    @property
    def device(self) -> torch.device:
        """Device the weights live on."""
        return self.token_embd.weight.device

    def new_cache(self, max_tokens: int) -> KVCache:
        """An empty KV cache for one sequence of up to ``max_tokens`` positions."""
        return KVCache.allocate(self.args, max_tokens, dtype=self.dtype, device=self.device)

    def forward(self, tokens: Tensor, positions: Tensor | None, cache: KVCache) -> Tensor:
        """Logits ``[T, vocab]`` (float32) for ``tokens[T]`` at ``positions`` (default: after the cache).

        Positions must be consecutive and start at most at ``cache.length``; afterwards
        ``cache.length`` is the last position + 1.
        """
        return self.forward_batch([(tokens, positions, cache)])[0]

    def forward_batch(
        self,
        batch: Sequence[tuple[Tensor, Tensor | None, KVCache]],
        *,
        last_only: bool = False,
        keep: Sequence[int] | None = None,
    ) -> list[Tensor]:
        """:meth:`forward` for several sequences at once: one matmul per layer for all their tokens.

        With ``last_only`` each sequence gets the logits of its last position only (``[1, vocab]``):
        a prefill then skips the lm_head for every other row, which on a 150k vocabulary is most
        of a long prompt's cost after the layers. ``keep`` generalises it: sequence ``i`` gets
        the logits of its last ``keep[i]`` positions (a speculative verifier's ``k + 1``).
        """
        if last_only:
            keep = [1] * len(batch)
        segments: list[_Segment] = []
        all_tokens, all_positions = [], []
        start = 0
        for tokens, positions, cache in batch:
            n = int(tokens.shape[0])
            first = cache.length if positions is None else int(positions[0])
            if n == 0:
                raise ValueError("forward needs at least one token per sequence")
            if first > cache.length:
                raise ValueError(f"positions start at {first} but the cache holds only {cache.length}")
            if first + n > cache.max_tokens:
                raise ContextOverflowError(first + n, cache.max_tokens, detail=" (KV cache size)")
            if positions is None:
                positions = torch.arange(first, first + n)
            mask = None
            if n > 1:  # query i sees slots 0..first+i (causal inside the new tokens)
                mask = torch.arange(first + n, device=self.device)[None, :] <= positions.to(self.device)[:, None]
            segments.append(_Segment(start, start + n, first, cache, mask))
            all_tokens.append(tokens)
            all_positions.append(positions)
            start += n
        tokens = torch.cat(all_tokens).to(self.device)
        positions = torch.cat(all_positions).to(self.device)
        angles = positions.to(torch.float64)[:, None] * self.inv_freq.to(self.device)[None, :]
        cos, sin = angles.cos().float(), angles.sin().float()
        x = self.token_embd(tokens)
        for layer, block in enumerate(self.blk):
            x = block(x, cos, sin, layer, segments)
        for seg in segments:
            seg.cache.length = seg.stop
        if keep is not None:
            counts = [max(1, min(int(n), seg.end - seg.start)) for n, seg in zip(keep, segments)]
            rows = [r for n, seg in zip(counts, segments) for r in range(seg.end - n, seg.end)]
            logits = self.output(self.output_norm(x[torch.tensor(rows, device=x.device)])).float()
            return list(logits.split(counts))
        logits = self.output(self.output_norm(x)).float()
        return [logits[seg.start : seg.end] for seg in segments]

    @classmethod
    def from_gguf(
        cls,
        path: str | os.PathLike[str],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        progress: bool = False,
        precision: str | None = None,
        fp8_skip: Sequence[str] = (),
    ) -> Transformer:
        """Load a llama/qwen2 GGUF file, dequantized to ``dtype`` (float32 or bfloat16).

        ``precision`` (one of :data:`PRECISIONS`) overrides ``dtype``: ``"fp32"`` and ``"bf16"``
        load in that dtype; ``"fp8"`` loads in ``dtype`` (the activation dtype) and converts the
        block linears to E4M3 weights (:func:`edgecloud.quant.convert_to_fp8`), keeping
        embeddings and the lm_head in ``dtype``, and the linears named in ``fp8_skip`` too
        (``blk.3.ffn_down``; a quantization config's ``keep_high_precision``).
        """
        from .weights import GGUFFile, load_state_dict

        if precision is not None:
            if precision not in PRECISIONS:
                raise InvalidRequestError(
                    f"unknown precision {precision!r}; allowed: {', '.join(PRECISIONS)}", param="precision"
                )
            dtype = PRECISIONS[precision] or dtype
        if fp8_skip and precision != "fp8":
            raise InvalidRequestError("fp8_skip applies to precision='fp8' only", param="fp8_skip")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        start = time.perf_counter()
        gguf_file = GGUFFile(path)
        args = ModelArgs.from_gguf(gguf_file.metadata, {n: t.shape for n, t in gguf_file.tensors.items()})
        state = load_state_dict(gguf_file, dtype=dtype, device=device, progress=progress)
        freq_factors = state.pop("rope_freqs.weight", None)
        if args.tied_embeddings:
            state["output.weight"] = state["token_embd.weight"]
        with torch.device("meta"):
            model = cls(args)
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as exc:
            raise ModelIntegrityError(f"{path}: tensors do not match a {args.arch} model: {exc}") from exc
        model.inv_freq = model._inv_freq(freq_factors).to(device)
        if precision == "fp8":
            from .fp8 import convert_to_fp8

            convert_to_fp8(model, keep=fp8_skip)
        model.load_seconds = time.perf_counter() - start
        return model.eval()


def param_bytes(model: nn.Module) -> int:
    """Bytes of all distinct parameters (a tied embedding counts once)."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())



def fuse_projections(model: Transformer) -> int:
    """Fuse each block's q/k/v and gate/up projections (plain ``nn.Linear`` only; see
    :meth:`Block.fuse`); returns how many blocks were fused. Call it before
    :func:`~edgecloud.engine.linear.pack_linears`."""
    return sum(1 for block in model.blk if isinstance(block, Block) and block.fuse())
