"""Reading a GGUF file's architecture without reading its weights.

This module owns :class:`ModelSpec` (the numbers the memory planner needs: layers, heads,
head sizes, vocabulary, trained context, weight bytes) and :func:`read_gguf_spec`, a small
GGUF header parser. It reads the header, the key/value metadata and the tensor-info table
with plain buffered ``read`` calls and never maps or touches the tensor data pages; it
then checks that the data region the tensor table describes lies inside the file, so a
truncated download is a :class:`~edgecloud.errors.ModelIntegrityError`, not a crash later in
llama.cpp. (``gguf.GGUFReader`` builds a numpy view per metadata item and takes ~14 s on
the 1.5B file here; this parser takes a few tens of milliseconds.)

GGUF layout (v2/v3): ``b"GGUF"``, u32 version, u64 tensor count, u64 kv count, the kv pairs
(string key, u32 type, value), the tensor infos (string name, u32 n_dims, u64 dims, u32
ggml type, u64 offset relative to the data start), padding to ``general.alignment``
(default 32), then the data.
"""

from __future__ import annotations

import os
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import ModelIntegrityError

__all__ = ["ModelSpec", "GGUFHeader", "read_gguf_spec", "read_gguf_header", "GGML_TYPE_SIZES", "GGUFHeaderReader"]

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
#: Refuse headers claiming more than this many bytes of metadata (a corrupt count would
#: otherwise make us read the whole file).
_MAX_HEADER_BYTES = 256 * 1024 * 1024

#: ggml type id -> (name, elements per block, bytes per block): gguf-py's own table
#: (``gguf.GGML_QUANT_SIZES``), so a type ggml adds arrives with the ``gguf`` package.
GGML_TYPE_SIZES: dict[int, tuple[str, int, int]] = {
    int(kind): (kind.name, *GGML_QUANT_SIZES[kind]) for kind in GGMLQuantizationType if kind in GGML_QUANT_SIZES
}

# GGUF metadata value types -> struct format (scalars) ; 8 = string, 9 = array.
_SCALAR_FORMATS: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class ModelSpec:
    """What the memory planner needs to know about a model, from GGUF metadata or a catalogue.

    ``weights_bytes`` is the size of all tensor data (what llama.cpp loads);
    ``output_bytes`` the part that is the output projection (or the tied token embedding),
    ``layer_bytes`` the average per-block weights, used to decide how many layers a GPU
    share can take. ``sliding_window`` is 0 for full attention.
    """

    name: str
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_vocab: int
    n_ctx_train: int
    n_ff: int
    weights_bytes: int
    file_bytes: int
    sliding_window: int = 0
    tied_embeddings: bool = False
    output_bytes: int = 0
    token_embd_bytes: int = 0
    layer_bytes: int = 0
    file_type: str = ""
    path: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim_k", "head_dim_v", "n_vocab"):
            value = vars(self)[name]
            if int(value) <= 0:
                raise ModelIntegrityError(f"model {self.name!r}: {name} must be positive, got {value}")
        if self.layer_bytes <= 0:
            rest = self.weights_bytes - self.output_bytes - (0 if self.tied_embeddings else self.token_embd_bytes)
            object.__setattr__(self, "layer_bytes", max(rest, 0) // self.n_layer)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (the catalogue ``spec`` shape)."""
        data = asdict(self)
        data.pop("extra")
        data.pop("path")
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, name: str | None = None) -> ModelSpec:
        """Build from a catalogue ``spec`` dict; unknown keys are ignored, missing ones derived."""
        d = dict(data)
        if name is not None:
            d["name"] = name
        try:
            n_embd, n_head = int(d["n_embd"]), int(d["n_head"])
            d.setdefault("n_head_kv", n_head)
            d.setdefault("head_dim_k", n_embd // n_head)
            d.setdefault("head_dim_v", d["head_dim_k"])
            d.setdefault("file_bytes", d.get("weights_bytes", 0))
            known = {f for f in cls.__dataclass_fields__ if f != "extra"}
            return cls(**{k: v for k, v in d.items() if k in known})
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelIntegrityError(f"catalogue spec for {d.get('name')!r} is incomplete: {exc}") from exc


class GGUFHeaderReader:
    """Sequential reader over the GGUF header; every short read is a ModelIntegrityError.

    The header is read into one buffer (16 MiB first, doubled on demand) because per-item
    ``read()`` calls would cost ~1 µs each and a tokenizer holds ~300k strings.
    """

    def __init__(self, fh: BinaryIO, path: Path, file_bytes: int) -> None:
        self._fh = fh
        self._path = path
        self._file_bytes = file_bytes
        self._buf = fh.read(min(file_bytes, 16 * 1024 * 1024))
        self._pos = 0

    def _grow(self, need_end: int) -> None:
        """Make the buffer reach byte ``need_end`` of the file."""
        if need_end <= len(self._buf):
            return
        if need_end > self._file_bytes:
            raise ModelIntegrityError(
                f"{self._path} is truncated: the GGUF header needs byte {need_end:,} "
                f"but the file has {self._file_bytes:,} bytes"
            )
        if need_end > _MAX_HEADER_BYTES:
            raise ModelIntegrityError(f"{self._path}: GGUF header larger than {_MAX_HEADER_BYTES:,} bytes; corrupt file")
        target = min(self._file_bytes, max(need_end, 2 * len(self._buf)))
        self._buf += self._fh.read(target - len(self._buf))
        if len(self._buf) < need_end:
            raise ModelIntegrityError(f"{self._path} is truncated inside the GGUF header")

    def _need(self, n: int) -> None:
        if self._pos + n > len(self._buf):
            self._grow(self._pos + n)

    @property
    def offset(self) -> int:
        return self._pos

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if n > _MAX_HEADER_BYTES:
            raise ModelIntegrityError(f"{self._path}: GGUF string of {n:,} bytes; corrupt header")
        self._need(n)
        raw = self._buf[self._pos:self._pos + n]
        self._pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        """Skip ``count`` strings without decoding them (the tokenizer vocabulary)."""
        unpack = struct.Struct("<Q").unpack_from
        while True:
            buf, pos = self._buf, self._pos
            try:
                for _ in range(count):
                    pos += 8 + unpack(buf, pos)[0]
            except struct.error:
                pos = len(buf) + 1
            if pos <= len(buf):
                self._pos = pos
                return
            if len(buf) >= self._file_bytes or len(buf) >= _MAX_HEADER_BYTES:
                raise ModelIntegrityError(f"{self._path} is truncated or corrupt inside the GGUF tokenizer metadata")
            self._grow(min(self._file_bytes, _MAX_HEADER_BYTES, 2 * len(buf)))

    def value(self, vtype: int) -> Any:
        """A metadata value; arrays of strings longer than 64 items come back as their length."""
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is not None:
            return self.scalar(fmt)
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type = self.scalar("<I")
            count = self.scalar("<Q")
            if item_type == _STRING:
                if count > 64:
                    self.skip_strings(count)
                    return _ArrayLen(count)
                return [self.string() for _ in range(count)]
            item_fmt = _SCALAR_FORMATS.get(item_type)
            if item_fmt is None:
                raise ModelIntegrityError(f"{self._path}: unsupported GGUF array item type {item_type}")
            size = struct.calcsize(item_fmt)
            if count * size > _MAX_HEADER_BYTES:
                raise ModelIntegrityError(f"{self._path}: GGUF array of {count:,} items; corrupt header")
            self._need(count * size)
            if count > 64:
                self._pos += count * size
                return _ArrayLen(count)
            values = list(struct.unpack_from("<" + item_fmt[1:] * count, self._buf, self._pos))
            self._pos += count * size
            return values
        raise ModelIntegrityError(f"{self._path}: unknown GGUF metadata type {vtype}")


class _ArrayLen(int):
    """Stands for a long metadata array whose items were skipped; the int is its length."""


def _tensor_bytes(path: Path, name: str, dims: tuple[int, ...], ggml_type: int) -> int:
    info = GGML_TYPE_SIZES.get(ggml_type)
    if info is None:
        raise ModelIntegrityError(f"{path}: tensor {name!r} has unknown ggml type {ggml_type}")
    _, block, type_size = info
    n = 1
    for d in dims:
        n *= d
    if dims and dims[0] % block:
        raise ModelIntegrityError(f"{path}: tensor {name!r} row of {dims[0]} is not a multiple of block {block}")
    return n // block * type_size


def _first(meta: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if key in meta:
            return meta[key]
    return default


def _as_int(value: Any) -> int:
    """Per-layer arrays (e.g. head_count_kv in some models) count as their largest value."""
    if isinstance(value, list):
        return int(max(value)) if value else 0
    return int(value)


@dataclass(frozen=True)
class GGUFHeader:
    """Everything in a GGUF file before the tensor data."""

    path: Path
    file_bytes: int
    metadata: dict[str, Any]
    #: (name, dims, ggml type, offset from the data start) per tensor, in file order.
    tensors: list[tuple[str, tuple[int, ...], int, int]]
    header_end: int

    @property
    def data_start(self) -> int:
        """File offset of the tensor data (the header end rounded up to the alignment)."""
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)) or _DEFAULT_ALIGNMENT
        return (self.header_end + alignment - 1) // alignment * alignment


def read_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse a GGUF header (metadata + tensor table) without touching tensor data.

    Missing file: ModelNotFoundError. Not GGUF, unknown version, or a short/corrupt header:
    ModelIntegrityError.
    """
    path = Path(path)
    try:
        file_bytes = path.stat().st_size
        fh = open(path, "rb")
    except OSError as exc:
        from ..errors import ModelNotFoundError

        raise ModelNotFoundError(f"cannot read model file {path}: {exc.strerror}") from exc
    with fh:
        head = fh.read(4)
        if head != _MAGIC:
            raise ModelIntegrityError(f"{path} is not a GGUF file (it does not start with b'GGUF')")
        fh.seek(0)
        hdr = GGUFHeaderReader(fh, path, file_bytes)
        hdr.scalar("<4s")  # re-read the magic so offsets are file offsets
        version = hdr.scalar("<I")
        if version not in (2, 3):
            raise ModelIntegrityError(f"{path}: unsupported GGUF version {version} (edgecloud reads v2 and v3)")
        n_tensors = hdr.scalar("<Q")
        n_kv = hdr.scalar("<Q")
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise ModelIntegrityError(f"{path}: implausible GGUF counts ({n_tensors} tensors, {n_kv} keys)")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = hdr.string()
            meta[key] = hdr.value(hdr.scalar("<I"))
        tensors: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = hdr.string()
            n_dims = hdr.scalar("<I")
            if n_dims > 8:
                raise ModelIntegrityError(f"{path}: tensor {name!r} has {n_dims} dims; corrupt header")
            dims = tuple(hdr.scalar("<Q") for _ in range(n_dims))
            ggml_type = hdr.scalar("<I")
            offset = hdr.scalar("<Q")
            tensors.append((name, dims, ggml_type, offset))
        header_end = hdr.offset
    return GGUFHeader(path, file_bytes, meta, tensors, header_end)


def read_gguf_spec(path: str | os.PathLike[str]) -> ModelSpec:
    """Read a GGUF file's architecture and weight sizes; bad or truncated files raise ModelIntegrityError."""
    h = read_gguf_header(path)
    return _spec_from_metadata(h.path, h.file_bytes, h.metadata, h.tensors, h.header_end)


def _spec_from_metadata(
    path: Path,
    file_bytes: int,
    meta: dict[str, Any],
    tensors: list[tuple[str, tuple[int, ...], int, int]],
    header_end: int,
) -> ModelSpec:
    alignment = int(meta.get("general.alignment", _DEFAULT_ALIGNMENT)) or _DEFAULT_ALIGNMENT
    data_start = (header_end + alignment - 1) // alignment * alignment
    weights = data_end = output_bytes = token_embd_bytes = 0
    names: set[str] = set()
    for name, dims, ggml_type, offset in tensors:
        n = _tensor_bytes(path, name, dims, ggml_type)
        names.add(name)
        weights += n
        data_end = max(data_end, data_start + offset + n)
        if name == "output.weight":
            output_bytes = n
        elif name == "token_embd.weight":
            token_embd_bytes = n
    if data_end > file_bytes:
        raise ModelIntegrityError(
            f"{path} is truncated: its tensors end at byte {data_end:,} but the file has {file_bytes:,} bytes; "
            "download it again"
        )
    arch = str(meta.get("general.architecture", ""))
    if not arch:
        raise ModelIntegrityError(f"{path}: GGUF metadata has no general.architecture")

    def key(suffix: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{suffix}", default)

    try:
        n_layer = _as_int(key("block_count"))
        n_embd = _as_int(key("embedding_length"))
        n_head = _as_int(key("attention.head_count"))
        n_head_kv = _as_int(key("attention.head_count_kv", n_head))
        head_dim_k = _as_int(key("attention.key_length", n_embd // max(n_head, 1)))
        head_dim_v = _as_int(key("attention.value_length", head_dim_k))
        n_vocab = _as_int(_first(meta, f"{arch}.vocab_size", "tokenizer.ggml.tokens", default=0))
        n_ctx_train = _as_int(key("context_length", 0))
        n_ff = _as_int(key("feed_forward_length", 0))
        sliding_window = _as_int(key("attention.sliding_window", 0))
    except (TypeError, ValueError) as exc:
        raise ModelIntegrityError(f"{path}: GGUF architecture metadata for {arch!r} is missing or malformed") from exc
    tied = "output.weight" not in names
    if tied:
        output_bytes = token_embd_bytes
    file_type = meta.get("general.file_type")
    return ModelSpec(
        name=path.stem,
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        n_vocab=n_vocab,
        n_ctx_train=n_ctx_train,
        n_ff=n_ff,
        weights_bytes=weights,
        file_bytes=file_bytes,
        sliding_window=sliding_window,
        tied_embeddings=tied,
        output_bytes=output_bytes,
        token_embd_bytes=token_embd_bytes,
        file_type=str(file_type) if file_type is not None else "",
        path=str(path),
        extra={"general.name": meta.get("general.name"), "n_tensors": len(tensors), "data_start": data_start},
    )
