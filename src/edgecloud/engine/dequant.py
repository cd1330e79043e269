"""Dequantizing GGUF tensors with torch: raw ggml blocks to float32, multi-threaded.

This module owns the block decoders of the ggml formats the engine meets in practice
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, plus the F32/F16/BF16 pass-throughs), a
registry of them keyed by ggml type id (:data:`DEQUANTIZERS`), and :func:`dequantize`, which
decodes a tensor's bytes chunk by chunk and falls back to ``gguf.quants.dequantize`` (numpy)
for any type not in the registry.

Why not ``gguf.quants`` alone: it is numpy, single-threaded, and took 30 s of the 45 s it
takes to load Qwen2.5-Coder-1.5B. The decoders here are the same arithmetic as gguf-py's
``dequantize_blocks`` (same float32 operations in the same order, fp16 scales widened
exactly to float32), written as torch ops so each pass runs on every intra-op thread, and
applied to bounded chunks of blocks so the int8/float32 temporaries stay small. The results
are bit-identical to ``gguf.quants.dequantize`` (``tests/engine/test_dequant.py``).

Every decoder reads a uint8 tensor ``[n_blocks, type_size]`` and writes float32
``[n_blocks, block_size]`` into a slice of the output, so no chunk is copied twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["DEQUANTIZERS", "BlockFormat", "dequantize"]

#: Elements decoded per chunk: large enough to amortise the per-op dispatch, small enough to
#: keep the temporaries (a few bytes per element) near the caches and the peak memory bounded.
#: Chunks are shared out over ``torch.get_num_threads()`` Python threads (torch ops release
#: the GIL) rather than left to each op's intra-op parallelism, which puts a thread barrier
#: after every small op: with another process busy on this 2-core machine, that made four
#: FFN matrices of the 1.5B take 15 s instead of 0.4 s.
CHUNK_ELEMENTS = 1 << 18

QK_K = 256  # elements per K-quant super-block

_BIT_MASKS = torch.tensor([1 << bit for bit in range(8)], dtype=torch.uint8)


@dataclass(frozen=True)
class BlockFormat:
    """One ggml block format: ``block_size`` elements stored in ``type_size`` bytes.

    ``decode(blocks, out)`` writes the float32 values of ``blocks`` (uint8
    ``[n, type_size]``) into ``out`` (float32 ``[n, block_size]``).
    """

    name: str
    block_size: int
    type_size: int
    decode: Callable[[Tensor, Tensor], None]


def _f16(blocks: Tensor, start: int) -> Tensor:
    """The fp16 stored at byte ``start`` of each block, widened (exactly) to float32 ``[n, 1]``."""
    return blocks[:, start : start + 2].view(torch.float16).float()


def _nibbles(qs: Tensor, width: int) -> Tensor:
    """Low then high nibbles of each ``width``-byte run of ``qs`` ``[n, k*width]`` -> uint8 ``[n, k, 2, width]``."""
    n = qs.shape[0]
    runs = qs.reshape(n, -1, width)
    q = torch.empty(n, runs.shape[1], 2, width, dtype=torch.uint8)
    torch.bitwise_and(runs, 0x0F, out=q[:, :, 0])
    torch.bitwise_right_shift(runs, 4, out=q[:, :, 1])
    return q


def _fifth_bits(qh: Tensor) -> Tensor:
    """Bit ``j`` of a 32-bit little-endian mask ``qh`` ``[n, 4]``, moved to bit 4, for j = 0..31 -> ``[n, 2, 16]``."""
    n = qh.shape[0]
    return torch.bitwise_and(qh.reshape(n, 4, 1), _BIT_MASKS).ne_(0).bitwise_left_shift_(4).reshape(n, 2, 16)


# torch.mul(uint8 or int8, float32, out=float32) widens the integers inside the kernel: the
# same float32 product as gguf-py's ``d * q.astype(np.float32)``, in one pass instead of two.


def _decode_q4_0(blocks: Tensor, out: Tensor) -> None:
    q = _nibbles(blocks[:, 2:], 16).view(torch.int8).sub_(8)
    torch.mul(q.reshape(out.shape), _f16(blocks, 0), out=out)


def _decode_q4_1(blocks: Tensor, out: Tensor) -> None:
    q = _nibbles(blocks[:, 4:], 16)
    torch.mul(q.reshape(out.shape), _f16(blocks, 0), out=out)
    out.add_(_f16(blocks, 2))


def _decode_q5_0(blocks: Tensor, out: Tensor) -> None:
    q = _nibbles(blocks[:, 6:], 16).reshape(-1, 2, 16).bitwise_or_(_fifth_bits(blocks[:, 2:6]))
    torch.mul(q.view(torch.int8).sub_(16).reshape(out.shape), _f16(blocks, 0), out=out)


def _decode_q5_1(blocks: Tensor, out: Tensor) -> None:
    q = _nibbles(blocks[:, 8:], 16).reshape(-1, 2, 16).bitwise_or_(_fifth_bits(blocks[:, 4:8]))
    torch.mul(q.reshape(out.shape), _f16(blocks, 0), out=out)
    out.add_(_f16(blocks, 2))


def _decode_q8_0(blocks: Tensor, out: Tensor) -> None:
    torch.mul(blocks[:, 2:].view(torch.int8), _f16(blocks, 0), out=out)


def _k_scales_mins(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """A Q4_K/Q5_K block's eight sub-block scales and offsets, float32 ``[n, 8, 1]`` each.

    The 12 bytes after d and dmin pack eight 6-bit scales and mins: bytes 0-3 hold scales 0-3
    (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same for the mins, bytes 8-11
    the low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high nibble).
    """
    n = blocks.shape[0]
    s = blocks[:, 4:16].reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1).float()
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1).float()
    return (_f16(blocks, 0) * sc).reshape(n, 8, 1), (_f16(blocks, 2) * mn).reshape(n, 8, 1)


def _decode_q4_k(blocks: Tensor, out: Tensor) -> None:
    n = blocks.shape[0]
    scale, offset = _k_scales_mins(blocks)
    q = _nibbles(blocks[:, 16:], 32).reshape(n, 8, 32)
    values = out.view(n, 8, 32)
    torch.mul(q, scale, out=values)
    values.sub_(offset)


def _decode_q5_k(blocks: Tensor, out: Tensor) -> None:
    n = blocks.shape[0]
    scale, offset = _k_scales_mins(blocks)
    # Bit k of qh byte j is the fifth bit of element j of sub-block k.
    qh = blocks[:, 16:48]
    high = torch.bitwise_and(qh.reshape(n, 1, 32), _BIT_MASKS.reshape(1, 8, 1)).ne_(0).bitwise_left_shift_(4)
    q = _nibbles(blocks[:, 48:], 32).reshape(n, 8, 32).bitwise_or_(high)
    values = out.view(n, 8, 32)
    torch.mul(q, scale, out=values)
    values.sub_(offset)


def _decode_q6_k(blocks: Tensor, out: Tensor) -> None:
    n = blocks.shape[0]
    q = _nibbles(blocks[:, :128], 64).reshape(n, 2, 4, 32)  # low 4 bits, [half, quarter, 32]
    qh = blocks[:, 128:192].reshape(n, 2, 32)
    # Crumb k of qh byte j (bits 2k, 2k+1) holds bits 4-5 of q[:, half, k, j].
    for k, shift in enumerate((4, 2, 0, -2)):
        shifted = qh << shift if shift >= 0 else qh >> -shift
        q[:, :, k].bitwise_or_(shifted & 0x30)
    scale = (_f16(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()).reshape(n, 16, 1)
    torch.mul(q.view(torch.int8).sub_(32).reshape(n, 16, 16), scale, out=out.view(n, 16, 16))


def _decode_f32(blocks: Tensor, out: Tensor) -> None:
    out.copy_(blocks.view(torch.float32))


def _decode_f16(blocks: Tensor, out: Tensor) -> None:
    out.copy_(blocks.view(torch.float16))


def _decode_bf16(blocks: Tensor, out: Tensor) -> None:
    out.copy_(blocks.view(torch.bfloat16))


#: ggml type id -> its block format; ids and sizes as in ggml.h.
DEQUANTIZERS: dict[int, BlockFormat] = {
    0: BlockFormat("F32", 1, 4, _decode_f32),
    1: BlockFormat("F16", 1, 2, _decode_f16),
    2: BlockFormat("Q4_0", 32, 18, _decode_q4_0),
    3: BlockFormat("Q4_1", 32, 20, _decode_q4_1),
    6: BlockFormat("Q5_0", 32, 22, _decode_q5_0),
    7: BlockFormat("Q5_1", 32, 24, _decode_q5_1),
    8: BlockFormat("Q8_0", 32, 34, _decode_q8_0),
    12: BlockFormat("Q4_K", QK_K, 144, _decode_q4_k),
    13: BlockFormat("Q5_K", QK_K, 176, _decode_q5_k),
    14: BlockFormat("Q6_K", QK_K, 210, _decode_q6_k),
    30: BlockFormat("BF16", 1, 2, _decode_bf16),
}


def _as_bytes(raw: np.ndarray | Tensor) -> np.ndarray | Tensor:
    """``raw`` flattened to uint8 (a view where possible)."""
    if isinstance(raw, Tensor):
        return raw.contiguous().view(torch.uint8).reshape(-1)
    return np.ascontiguousarray(raw).view(np.uint8).reshape(-1)


def _to_tensor(chunk: np.ndarray | Tensor) -> Tensor:
    if isinstance(chunk, Tensor):
        return chunk
    # A copy: GGUF data is a read-only memory map, which torch.from_numpy refuses to wrap
    # silently; the quantized bytes are a fraction of the float32 output, so this is cheap.
    return torch.from_numpy(np.array(chunk, copy=True))


def _dequantize_with_gguf(raw: np.ndarray | Tensor, ggml_type: int, shape: tuple[int, ...]) -> Tensor:
    import gguf.quants
    from gguf import GGMLQuantizationType

    data = raw.numpy() if isinstance(raw, Tensor) else raw
    values = gguf.quants.dequantize(np.asarray(data, dtype=np.uint8), GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.array(values, dtype=np.float32, copy=True)).reshape(shape)


def dequantize(raw: np.ndarray | Tensor, ggml_type: int, shape: Sequence[int]) -> Tensor:
    """A tensor's raw ggml bytes as a fresh float32 tensor of ``shape`` (torch order).

    ``raw`` is the tensor's data (uint8, any shape, e.g. a view of a memory-mapped file); it is
    decoded ``CHUNK_ELEMENTS`` at a time into one preallocated output. Types outside
    :data:`DEQUANTIZERS` go through ``gguf.quants.dequantize``, which raises
    ``NotImplementedError`` for types it cannot decode either. ``ValueError`` if the byte count
    does not match ``shape``.
    """
    shape = tuple(int(s) for s in shape)
    fmt = DEQUANTIZERS.get(ggml_type)
    if fmt is None:
        return _dequantize_with_gguf(raw, ggml_type, shape)
    data = _as_bytes(raw)
    n_elements = 1
    for s in shape:
        n_elements *= s
    if n_elements % fmt.block_size or data.shape[0] != n_elements // fmt.block_size * fmt.type_size:
        raise ValueError(
            f"{fmt.name} data of {data.shape[0]} bytes does not hold a tensor of shape {shape} "
            f"(blocks of {fmt.block_size} elements in {fmt.type_size} bytes)"
        )
    n_blocks = n_elements // fmt.block_size
    blocks = data.reshape(n_blocks, fmt.type_size)
    out = torch.empty(n_blocks, fmt.block_size, dtype=torch.float32)
    step = max(1, CHUNK_ELEMENTS // fmt.block_size)
    starts = range(0, n_blocks, step)

    def decode_chunk(start: int) -> None:
        stop = min(start + step, n_blocks)
        fmt.decode(_to_tensor(blocks[start:stop]), out[start:stop])

    workers = min(torch.get_num_threads(), len(starts))
    if workers <= 1:
        for start in starts:
            decode_chunk(start)
    else:
        with ThreadPoolExecutor(workers) as pool:
            for _ in pool.map(decode_chunk, starts):
                pass
    return out.reshape(shape)
