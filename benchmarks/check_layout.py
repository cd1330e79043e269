"""Whether the cloud's weight layout, not the policy, sets what a check costs on a CPU.

A verified check makes ``edgecloud serve`` (llama.cpp) compute a batch of ``k + 1`` positions. In
the published 1.5B (``Q4_K_M``) the Q4_K tensors are repacked for batched kernels on x86, but the
Q6_K ones (the output head, half the ``ffn_down`` and ``attn_v`` tensors) are not: each batch row
costs them a full vector pass, so a check of 8 costs almost 8 decode steps of those tensors. This
benchmark re-encodes the Q6_K tensors as Q8_0 (which llama.cpp computes as one matrix product per
batch) in two copies of the file, the output head alone and every Q6_K tensor, and measures, on
this machine, with two threads:

* the time of a pass over ``k + 1`` positions (the check of ``k`` drafts) and of a decode step;
* how often the re-encoded model's greedy pick is the published file's, teacher-forced over the
  first 1,500 tokens of a source file (the hybrid keeps the cloud's answer, so a layout that
  changes the cloud's picks changes what every mode writes).

    python benchmarks/check_layout.py     # -> results/check_layout.json

Measured, not shipped: see the README ("Longer blocks do not pay").
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent.parent / "src"))

RESULTS = Path(__file__).parent / "results"
CLOUD_MODEL = "qwen2.5-coder-1.5b-instruct-q4"
KS = (0, 1, 2, 4, 6, 8, 11, 15)
CONTEXT = 300
REPS = 10


def reencode(source: Path, target: Path, only_head: bool) -> int:
    """``source`` with its Q6_K tensors (``only_head``: the output head alone) as Q8_0; how many."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(str(target), bytes(arch.parts[arch.data[0]]).decode())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            values = [bytes(field.parts[i]) if sub == gguf.GGUFValueType.STRING else field.parts[i].tolist()[0]
                      for i in field.data]
            writer.add_key_value(field.name, values, kind, sub_type=sub)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_key_value(field.name, bytes(field.parts[field.data[0]]), kind)
        else:
            writer.add_key_value(field.name, field.parts[field.data[0]].tolist()[0], kind)
    changed = 0
    for tensor in reader.tensors:
        wanted = tensor.tensor_type == Q.Q6_K and tensor.name != "token_embd.weight" and \
            (not only_head or tensor.name == "output.weight")
        if wanted:
            shape = [int(x) for x in reversed(tensor.shape)]
            values = gguf.quants.dequantize(tensor.data, Q.Q6_K).reshape(shape).astype(np.float32)
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, Q.Q8_0), raw_dtype=Q.Q8_0)
            changed += 1
        else:
            writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return changed


def measure(paths: dict[str, Path]) -> dict[str, Any]:
    """Pass times by ``k`` and greedy agreement with the first of ``paths``, interleaved."""
    import llama_cpp
    import numpy as np

    models = {name: llama_cpp.Llama(str(p), n_ctx=2048, n_threads=2, n_threads_batch=2, logits_all=True,
                                    verbose=False) for name, p in paths.items()}
    first = next(iter(models.values()))
    text = (Path(__file__).parent.parent / "src" / "edgecloud" / "collab" / "verified.py").read_bytes()
    tokens = first.tokenize(text)[:1500]
    picks = {}
    for name, llm in models.items():
        llm.reset()
        llm.eval(tokens)
        picks[name] = np.argmax(np.asarray(llm.scores[:len(tokens)]), axis=1)
    times: dict[tuple[str, int], list[float]] = {(name, k): [] for name in models for k in KS}
    for _ in range(REPS):
        for name, llm in models.items():
            llm.reset()
            llm.eval(tokens[:CONTEXT])
            for k in KS:
                llm.n_tokens = CONTEXT
                llm._ctx.kv_cache_seq_rm(-1, CONTEXT, -1)
                started = time.perf_counter()
                llm.eval(tokens[CONTEXT:CONTEXT + k + 1])
                times[(name, k)].append(time.perf_counter() - started)
    base = next(iter(models))
    out: dict[str, Any] = {}
    for name in models:
        by_k = {str(k): round(1000 * statistics.median(times[(name, k)]), 1) for k in KS}
        out[name] = {"pass_ms_by_drafts": by_k,
                     "per_drafted_token_ms_at_8": round((by_k["8"] - by_k["0"]) / 8, 1),
                     "greedy_agrees_with_published": round(float((picks[name] == picks[base]).mean()), 4),
                     "positions": len(tokens)}
    return out


def main() -> None:
    from edgecloud.store import resolve_model

    source = Path(resolve_model(CLOUD_MODEL))
    with tempfile.TemporaryDirectory() as tmp:
        head, every = Path(tmp) / "head-q8_0.gguf", Path(tmp) / "q6k-as-q8_0.gguf"
        changed = {"output head as Q8_0": reencode(source, head, True),
                   "every Q6_K tensor as Q8_0": reencode(source, every, False)}
        out = {"cloud": CLOUD_MODEL, "threads": 2, "context": CONTEXT, "tensors_reencoded": changed,
               "layouts": measure({"published (Q4_K_M)": source, "output head as Q8_0": head,
                                   "every Q6_K tensor as Q8_0": every})}
    (RESULTS / "check_layout.json").write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
