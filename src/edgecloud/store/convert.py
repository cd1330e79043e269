"""GGUF files as Hugging Face checkpoints, converted once and kept in the cache: what vLLM loads.

This module owns :func:`hf_checkpoint`. vLLM needs a Hugging Face checkpoint (its own GGUF
path wants the original tokenizer from a hub, is marked experimental, and its dequantizing
kernels need CUDA), while this project's models come as GGUF files. transformers reads a GGUF
file (dequantizing every tensor) and writes safetensors plus a tokenizer; the result is kept at
``<cache>/hf/<stem>-<sha256[:16]>/`` next to a manifest (``edgecloud-checkpoint.json``: the
source's sha256, the dtype, the transformers version, and each written file's size and
sha256), so the next start reuses it after checking those files, and a changed source file
gets a checkpoint of its own.

The conversion runs in a child process (``python -m edgecloud.store.convert``): it peaks at
several times the model's size in memory (the 0.5B model: about 4 GB, 60 s on 2 cores), and the
process that then supervises vLLM should not keep that. It needs ``transformers`` and
``torch`` (both come with vLLM, and with ``edgecloud[vllm]``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import BackendUnavailableError, ModelIntegrityError
from .cache import exclusive_lock, home_dir, sha256_file

__all__ = ["MANIFEST", "checkpoint_dir", "hf_checkpoint", "is_checkpoint"]

MANIFEST = "edgecloud-checkpoint.json"
#: Files a checkpoint must have besides its weights for vLLM to serve it.
_REQUIRED = ("config.json", "tokenizer.json")


def checkpoint_dir(gguf: Path, sha256: str) -> Path:
    """Where the checkpoint converted from ``gguf`` (whose hash is ``sha256``) lives."""
    return home_dir() / "hf" / f"{gguf.stem}-{sha256[:16]}"


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a directory holding a Hugging Face checkpoint (a ``config.json``)."""
    return path.is_dir() and (path / "config.json").is_file()


def _intact(directory: Path, source_sha256: str) -> bool:
    """The manifest names this source and every file it lists still has its size and hash."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    files: dict[str, Any] = manifest.get("files", {})
    if manifest.get("source_sha256") != source_sha256 or not all(name in files for name in _REQUIRED):
        return False
    for name, facts in files.items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != facts.get("size") or sha256_file(path) != facts.get("sha256"):
            return False
    return True


def hf_checkpoint(gguf: Path, *, sha256: str | None = None, dtype: str = "bfloat16", progress: bool = True) -> Path:
    """The Hugging Face checkpoint of ``gguf``: reused when intact, else converted now.

    ``sha256`` is the file's hash when already known (a verified catalogue file); otherwise it is
    computed. Raises :class:`~edgecloud.errors.BackendUnavailableError` when transformers is
    missing or the conversion fails (with transformers' own message).
    """
    gguf = Path(gguf)
    digest = sha256 or sha256_file(gguf)
    target = checkpoint_dir(gguf, digest)
    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(target.parent / f".{target.name}.lock"):
        if _intact(target, digest):
            return target
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        if progress:
            print(f"edgecloud: converting {gguf.name} to a Hugging Face checkpoint for vLLM (once; "
                  f"kept in {target.parent})", file=sys.stderr, flush=True)
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "edgecloud.store.convert", str(gguf), str(partial), dtype, digest],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        if result.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            reason = _last_error(result.stderr) or f"exit status {result.returncode}"
            raise BackendUnavailableError(f"could not convert {gguf.name} to a Hugging Face checkpoint: {reason}",
                                          cause="load_error")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(partial, target)
        if progress:
            print(f"edgecloud: converted in {time.monotonic() - started:.0f} s: {target}", file=sys.stderr, flush=True)
    return target


def _last_error(stderr: str) -> str:
    """The last line that looks like an exception (``SomeError: message``), else the last line."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and " " not in head:
            return line
    return lines[-1] if lines else ""


def _convert(gguf: Path, out: Path, dtype: str, digest: str) -> None:
    """Read ``gguf`` with transformers and write the checkpoint and its manifest to ``out``."""
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise SystemExit(f"ImportError: converting GGUF for vLLM needs transformers and torch ({exc}); "
                         "pip install 'edgecloud[vllm]'") from exc
    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch_dtype)
    # The weights are dequantized now; transformers still marks the model as GGUF-quantized and
    # refuses to save it while the mark is there.
    model.hf_quantizer = None
    if "quantization_config" in vars(model.config):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(out.iterdir()) if p.is_file()}
    for name in _REQUIRED:
        if name not in files:
            raise ModelIntegrityError(f"the converted checkpoint has no {name}")
    manifest = {"source": gguf.name, "source_sha256": digest, "dtype": dtype,
                "transformers": transformers.__version__, "files": files}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    _convert(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4])
