"""On a CUDA machine: the FP8 ``_scaled_mm`` path checked, FP8 vs bf16 throughput of the torch engine,
and the same model on vLLM. Exits with a message (status 2) where no CUDA GPU is visible.

1. ``scaled_mm``: every block linear of the model as :class:`~edgecloud.engine.fp8.FP8Linear`
   on real activations (the packaged text teacher-forced through the bf16 model): the native
   path (``torch._scaled_mm``, per-token activation scales) against the same layer's
   quantize-dequantize path (exact FP8 weights, bf16 activations) and against bf16. Reported:
   the worst relative error per comparison, which layers ran natively, and the model's
   top-1 agreement / NLL change of FP8 vs bf16 (the self-check ``--quant auto`` runs).
2. ``torch_engine``: :class:`~edgecloud.serving.engine_backend.TorchEngineBackend` in bf16 and in
   FP8 on the GPU, 1 / 8 / 16 concurrent greedy streams of ``--tokens`` tokens, tokens/s.
3. ``spec_pass``: what edge speculation needs from the device (issue 30): the bf16 model's
   forward pass of 1, 2, 3, 4, 8 and 16 rows after a 320-token context, in ms (median of 20),
   as a multiple of one row, and whether the rows' logits equal those of single steps bitwise
   (their largest difference and whether the argmax agrees): speculation pays where k + 1 rows
   cost about one, and is exact where they round alike.
4. ``vllm``: where vLLM is installed, its OpenAI server on the same model (converted from the
   GGUF like ``edgecloud serve --engine vllm``), bf16 and ``--quantization fp8``, same levels
   (``benchmarks/serving.py``'s client).

Prints JSON and writes ``benchmarks/results/gpu_check.json``.

    python benchmarks/gpu_check.py [--model qwen2.5-coder-1.5b-instruct-q4] [--tokens 64] [--skip vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from _common import model_path

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_check.json"
LEVELS = (1, 8, 16)


def check_scaled_mm(path: Path) -> dict[str, Any]:
    from edgecloud.engine import Tokenizer, Transformer
    from edgecloud.engine.fp8 import FP8Linear, convertible_layers, scaled_mm_supported
    from edgecloud.serving.fp8_check import fp8_self_check

    model = Transformer.from_gguf(path, precision="bf16", device="cuda")
    tokenizer = Tokenizer(path)
    inputs: dict[str, torch.Tensor] = {}

    def keep_input(name: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            inputs.setdefault(name, args[0].detach())  # returns None: a hook's return value replaces the output

        return hook

    hooks = [model.get_submodule(name).register_forward_hook(keep_input(name)) for name in convertible_layers(model)]
    ids = tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n" * 8)[:256]
    with torch.inference_mode():
        model(torch.tensor(ids), None, model.new_cache(len(ids)))
    for hook in hooks:
        hook.remove()
    worst = {"native_vs_qdq": 0.0, "native_vs_bf16": 0.0, "qdq_vs_bf16": 0.0}
    native = fallback = 0
    with torch.inference_mode():
        for name, x in inputs.items():
            linear = model.get_submodule(name)
            fp8 = FP8Linear.from_linear(linear)
            ref = linear(x).float()
            qdq = fp8._forward_dequantized(x).float()
            if scaled_mm_supported(x.device) and fp8.in_features % 16 == 0 and fp8.out_features % 16 == 0:
                out = fp8._forward_scaled_mm(x).float()
                native += 1
            else:
                out = qdq
                fallback += 1

            def rel(a: torch.Tensor, b: torch.Tensor) -> float:
                return float((a - b).norm() / b.norm().clamp_min(1e-12))

            worst["native_vs_qdq"] = max(worst["native_vs_qdq"], rel(out, qdq))
            worst["native_vs_bf16"] = max(worst["native_vs_bf16"], rel(out, ref))
            worst["qdq_vs_bf16"] = max(worst["qdq_vs_bf16"], rel(qdq, ref))
    check = fp8_self_check(model, tokenizer)
    tokenizer.close()
    return {
        "gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
        "layers_native": native, "layers_quantize_dequantize": fallback,
        "worst_relative_error": {k: round(v, 5) for k, v in worst.items()},
        "self_check": {"passed": check.passed, "top1_agreement": round(check.top1_agreement, 4),
                       "nll_delta_pct": round(check.nll_delta_pct, 3), "positions": check.positions},
    }


def spec_pass(path: Path, context: int = 320, repeats: int = 20, device: str = "cuda") -> dict[str, Any]:
    from edgecloud.engine import Tokenizer, Transformer

    model = Transformer.from_gguf(path, precision="bf16", device=device)
    tokenizer = Tokenizer(path)
    text = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n" * 40
    ids = tokenizer.encode(text)[: context + 16]
    cache = model.new_cache(len(ids) + 1)
    out: dict[str, Any] = {"context": context}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.inference_mode():
        model(torch.tensor(ids[:context], device=device), None, cache)
        singles = []
        for i in range(16):  # one row at a time: the reference a guess is checked against
            singles.append(model(torch.tensor(ids[context + i : context + i + 1], device=device), None, cache)[0])
        for rows in (1, 2, 3, 4, 8, 16):
            block = torch.tensor(ids[context : context + rows], device=device)
            times = []
            for _ in range(repeats + 3):
                cache.truncate(context)
                sync()
                started = time.perf_counter()
                logits = model(block, None, cache)
                sync()
                times.append(time.perf_counter() - started)
            diff = max(float((logits[i] - singles[i]).abs().max()) for i in range(rows))
            same_argmax = all(int(logits[i].argmax()) == int(singles[i].argmax()) for i in range(rows))
            out[str(rows)] = {"ms": round(sorted(times[3:])[repeats // 2] * 1e3, 3), "max_logit_diff": diff,
                              "bitwise": diff == 0.0, "argmax_agrees": same_argmax}
    one = out["1"]["ms"]
    for rows in (2, 3, 4, 8, 16):
        out[str(rows)]["x_one_row"] = round(out[str(rows)]["ms"] / one, 2)
    return out


def torch_engine(path: Path, precision: str, tokens: int) -> dict[str, Any]:
    from edgecloud.serving.engine_backend import TorchEngineBackend
    from edgecloud.runtime.sampling import SamplingParams

    backend = TorchEngineBackend(path, precision=precision, device="cuda", max_batch=max(LEVELS), n_ctx=2048)
    backend.load()
    prompts = [backend.tokenize_chat([{"role": "user", "content": f"Write a Python function number {i}."}])
               for i in range(max(LEVELS))]
    out: dict[str, Any] = {"precision": backend.precision}
    try:
        for level in (1, *LEVELS):  # the first level-1 run warms up
            params = SamplingParams(tokens, temperature=0.0, stop_at_eog=False)
            started = time.perf_counter()
            seqs = [backend.scheduler.submit(p, params) for p in prompts[:level]]
            counts = [0] * level
            threads = [threading.Thread(target=lambda i=i: counts.__setitem__(i, len(list(seqs[i])))) for i in range(level)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            out[str(level)] = round(sum(counts) / (time.perf_counter() - started), 1)
    finally:
        backend.close()
    return out


def vllm_levels(model: str, quant: str, tokens: int) -> dict[str, Any]:
    import subprocess

    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from faults import free_port
    from serving import PROMPTS, measure_level

    from edgecloud.serving.vllm import VLLMSettings, vllm_command, vllm_environment
    from edgecloud.serving.vllm_launch import find_vllm, vllm_sources

    install = find_vllm()
    if install is None or install.problem:
        return {"skipped": install.problem if install else "vLLM is not installed"}
    settings = VLLMSettings(model, port=free_port(), quant=quant, max_batch=max(LEVELS), ctx=2048,  # type: ignore[arg-type]
                            tensor_parallel_size=1)
    source, _ = vllm_sources(settings)
    argv = vllm_command(settings, source, python=install.python, module=install.module)
    proc = subprocess.Popen(argv, env=vllm_environment(settings, cpu=install.cpu), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{settings.port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                return {"error": f"vLLM did not start (status {proc.poll()})"}
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(2)
        asyncio.run(measure_level(url, model, ["Say hello."], 8))
        return {str(c): asyncio.run(measure_level(url, model, PROMPTS[:c], tokens))["tokens_per_s"] for c in LEVELS}
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct-q4")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--skip", default="", help="comma-separated: scaled_mm, spec_pass, torch, vllm")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU is visible here; run it on a machine with one", file=sys.stderr)
        raise SystemExit(2)
    skip = set(filter(None, args.skip.split(",")))
    path = model_path(args.model)
    report: dict[str, Any] = {"benchmark": "gpu_check", "model": args.model, "torch": torch.__version__}
    if "scaled_mm" not in skip:
        report["scaled_mm"] = check_scaled_mm(path)
    if "spec_pass" not in skip:
        report["spec_pass"] = spec_pass(path)
    if "torch" not in skip:
        report["torch_engine"] = {p: torch_engine(path, p, args.tokens) for p in ("bf16", "fp8")}
        bf16, fp8 = report["torch_engine"]["bf16"], report["torch_engine"]["fp8"]
        report["torch_engine"]["fp8_vs_bf16"] = {str(c): round(fp8[str(c)] / bf16[str(c)], 3) for c in LEVELS}
    if "vllm" not in skip:
        report["vllm"] = {q: vllm_levels(args.model, q, args.tokens) for q in ("bf16", "fp8")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
