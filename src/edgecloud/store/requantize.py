"""Catalogue models made here from another one: a GGUF requantized by llama.cpp's own quantizer.

This module owns :func:`make` and :func:`recorded`. A catalogue entry whose source is
``{"kind": "requantized", "base": <entry>, "type": <GGML type>}`` is not downloaded: its base is
pulled (and verified) as usual, then llama.cpp rewrites it as its ``type`` mix (the output head
and the token embedding as ``type`` too) with ``allow_requantize``. The default edge model is
made this way: the published 0.5B "Q4_K_M" file is mostly Q5_0 and Q8_0 (its 896-wide rows fit
no K-quant); requantized as IQ4_NL (97 % of its bytes; llama.cpp keeps a few tensors at 5 bits)
it decodes about 1.8x faster on a CPU with AVX-512 and agrees with the cloud model's greedy
picks almost as often (``benchmarks/edge_quant.py`` measures both).

The bytes depend on the llama.cpp build that made them, so the catalogue pins no hash; the
made file's hash is recorded beside it (``<file>.made.json``, with the base's hash, the type
and the llama.cpp version) and checked like a downloaded file's. The quantizer runs in a child
process (``python -m edgecloud.store.requantize``): llama.cpp prints a line per tensor, and a
failure there must not take the caller's process with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import ModelFetchError, ModelIntegrityError
from .cache import forget_verified, known_sha256, record_verified, sha256_file
from .catalogue import CatalogueEntry

__all__ = ["make", "made_record", "recorded"]


def _record_path(path: Path) -> Path:
    return path.with_name(path.name + ".made.json")


def made_record(path: Path) -> dict[str, Any] | None:
    """What :func:`make` wrote beside ``path`` (its base, type, size and sha256), or None."""
    try:
        record = json.loads(_record_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def recorded(entry: CatalogueEntry, path: Path) -> tuple[int, str]:
    """The size and sha256 :func:`make` recorded for ``path`` as ``entry``'s file (what
    :func:`edgecloud.store.fetch.verify` checks it against); ModelIntegrityError when there is no
    record of making it from the entry's base as its type."""
    record = made_record(path)
    if record is None or record.get("base") != entry.source.base or record.get("type") != entry.source.type:
        raise ModelIntegrityError(f"{path} has no record of being made from {entry.source.base} as "
                                  f"{entry.source.type}; run `edgecloud models pull {entry.name} --force` to "
                                  "make it again")
    return int(record["size"]), str(record["sha256"])


def make(entry: CatalogueEntry, base: Path, dest: Path, *, progress: bool = True) -> Path:
    """Requantize ``base`` (the verified file of ``entry.source.base``) as ``entry.source.type``
    into ``dest``, atomically, with its record. ModelFetchError when llama.cpp is missing or its
    quantizer fails (with its own last words); nothing is left at ``dest`` then."""
    partial = dest.with_name(f".{dest.name}.{os.getpid()}.partial")
    if progress:
        print(f"edgecloud: making {entry.name} from {entry.source.base} ({entry.source.type}, once; about "
              f"a minute)", file=sys.stderr, flush=True)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "edgecloud.store.requantize", str(base), str(partial),
                             str(entry.source.type)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if result.returncode != 0:
            lines = [line for line in (result.stderr or result.stdout).strip().splitlines() if line.strip()]
            reason = lines[-1] if lines else f"exit status {result.returncode}"
            raise ModelFetchError(f"could not make {entry.name} from {base.name}: {reason}")
        digest = sha256_file(partial)
        record = {"base": entry.source.base, "base_sha256": known_sha256(base), "type": entry.source.type,
                  "llama_cpp": (result.stdout.strip().splitlines() or [""])[-1], "size": partial.stat().st_size, "sha256": digest}
        forget_verified(dest)
        os.replace(partial, dest)
        _record_path(dest).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        record_verified(dest, digest)
    finally:
        partial.unlink(missing_ok=True)
    if progress:
        print(f"edgecloud: made {dest.name} ({record['size'] / 2**20:.0f} MiB) in {time.monotonic() - started:.0f} s",
              file=sys.stderr, flush=True)
    return dest


def _quantize(base: str, out: str, type_name: str) -> None:
    """The child process: llama.cpp's quantizer, its ``type_name`` mix (the head and embedding as
    ``type_name``); prints the version."""
    import ctypes

    try:
        import llama_cpp
    except ImportError as exc:
        raise SystemExit(f"ImportError: making a requantized model needs llama-cpp-python ({exc}); "
                         "pip install 'edgecloud[edge]'") from exc
    names = vars(llama_cpp)  # the type's constants, by the names llama.cpp gives them
    ggml_type, ftype = names.get(f"GGML_TYPE_{type_name}"), names.get(f"LLAMA_FTYPE_MOSTLY_{type_name}")
    if ggml_type is None or ftype is None:
        raise SystemExit(f"ValueError: llama.cpp {llama_cpp.__version__} has no quantization type {type_name}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.output_tensor_type = ggml_type  # the head too: it is a third of a small model's bytes per token
    params.token_embedding_type = ggml_type
    # the CPUs this process may use (its affinity, where the platform has one)
    params.nthread = len(os.sched_getaffinity(0)) if sys.platform.startswith("linux") else (os.cpu_count() or 1)
    if llama_cpp.llama_model_quantize(base.encode(), out.encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"RuntimeError: llama.cpp could not quantize {base} as {type_name} (see above)")
    print(llama_cpp.__version__)


if __name__ == "__main__":
    _quantize(sys.argv[1], sys.argv[2], sys.argv[3])
