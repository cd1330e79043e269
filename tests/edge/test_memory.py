"""The memory planner against real GGUF files and real llama.cpp allocations."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from edgecloud.edge.device import DeviceProfile
from edgecloud.edge.memory import (
    DEFAULT_MAX_CONTEXT,
    KV_CACHE_TYPES,
    MemoryPlan,
    kv_cache_bytes,
    model_spec,
    plan,
    read_gguf_spec,
)
from edgecloud.errors import InvalidRequestError, ModelIntegrityError

GiB = 1024**3
MiB = 1024**2
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "memory_accuracy.py"


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> Path:
    return smollm2_path


@pytest.fixture(scope="module")
def qwen05(qwen05_path: Path) -> Path:
    return qwen05_path


def _device(budget: int, name: str = "test") -> DeviceProfile:
    return DeviceProfile(name=name, description="test budget", total_bytes=max(budget, GiB) * 2, budget_bytes=budget)


# --- reading GGUF metadata -------------------------------------------------------------


def test_spec_of_smollm2_matches_its_config(smollm2: Path) -> None:
    spec = read_gguf_spec(smollm2)
    assert (spec.arch, spec.n_layer, spec.n_embd, spec.n_head, spec.n_head_kv) == ("llama", 30, 576, 9, 3)
    assert (spec.head_dim_k, spec.head_dim_v, spec.n_vocab, spec.n_ctx_train, spec.n_ff) == (64, 64, 49152, 8192, 1536)
    assert spec.tied_embeddings
    assert spec.file_bytes == 98_362_432
    # tensor data = file minus the (aligned) header
    assert spec.weights_bytes == 96_576_768
    assert 0 < spec.weights_bytes < spec.file_bytes


def test_spec_of_qwen05_matches_its_config(qwen05: Path) -> None:
    spec = read_gguf_spec(qwen05)
    assert (spec.arch, spec.n_layer, spec.n_embd, spec.n_head, spec.n_head_kv) == ("qwen2", 24, 896, 14, 2)
    assert (spec.head_dim_k, spec.n_vocab, spec.n_ctx_train, spec.n_ff) == (64, 151936, 32768, 4864)
    assert not spec.tied_embeddings
    assert spec.weights_bytes == 485_452_288


def test_truncated_gguf_is_an_integrity_error(smollm2: Path, tmp_path: Path) -> None:
    head = tmp_path / "head.gguf"
    with open(smollm2, "rb") as src:
        head.write_bytes(src.read(1 * MiB))
    with pytest.raises(ModelIntegrityError, match="truncated"):
        read_gguf_spec(head)


def test_gguf_missing_its_last_tensor_bytes_is_an_integrity_error(smollm2: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    data = smollm2.read_bytes()
    cut.write_bytes(data[: len(data) - 4096])
    with pytest.raises(ModelIntegrityError, match="truncated"):
        read_gguf_spec(cut)


def test_not_a_gguf_is_an_integrity_error(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 100)
    with pytest.raises(ModelIntegrityError, match="not a GGUF"):
        read_gguf_spec(bogus)
    with pytest.raises(ModelIntegrityError):
        plan(bogus, _device(4 * GiB))


def test_catalogue_model_is_planned_from_its_spec_without_the_file() -> None:
    spec = model_spec("llama-3.2-3b-instruct-q4")
    assert (spec.n_layer, spec.n_head_kv, spec.head_dim_k) == (28, 8, 128)
    assert spec.weights_bytes > 1.5 * GiB


# --- the plan ------------------------------------------------------------------------------


def test_plan_for_given_context(smollm2: Path) -> None:
    p = plan(smollm2, _device(4 * GiB), ctx=2048)
    assert p.fits and p.n_ctx == 2048 and p.kv_cache_type == "f16"
    spec = read_gguf_spec(smollm2)
    # 30 layers * 2048 cells * 3 kv heads * (64 + 64) dims * 2 bytes
    assert p.kv_bytes == kv_cache_bytes(spec, 2048) == 30 * 2048 * 3 * 128 * 2
    assert p.total_bytes == p.weights_bytes + p.kv_bytes + p.compute_bytes + p.overhead_bytes
    assert p.max_context == spec.n_ctx_train
    d = p.to_dict()
    json.dumps(d)
    for key in ("fits", "reason", "weights_bytes", "kv_bytes", "compute_bytes", "overhead_bytes", "total_bytes",
                "budget_bytes", "max_context", "kv_cache_type", "n_ctx", "gpu_layers", "device", "model"):
        assert key in d


def test_no_ctx_plans_the_largest_context_up_to_the_default(smollm2: Path) -> None:
    p = plan(smollm2, _device(4 * GiB))
    assert p.fits and p.n_ctx == min(DEFAULT_MAX_CONTEXT, 8192)
    tight = plan(smollm2, _device(int(p.total_bytes - 20 * MiB)))
    assert tight.fits
    assert tight.n_ctx < p.n_ctx or tight.kv_cache_type != "f16"
    assert tight.total_bytes <= tight.budget_bytes


def test_cache_type_drops_to_q8_then_q4_when_f16_does_not_fit(smollm2: Path) -> None:
    f16 = plan(smollm2, _device(4 * GiB), ctx=8192, kv_cache_type="f16")
    q8 = plan(smollm2, _device(4 * GiB), ctx=8192, kv_cache_type="q8_0")
    q4 = plan(smollm2, _device(4 * GiB), ctx=8192, kv_cache_type="q4_0")
    assert f16.kv_bytes > q8.kv_bytes > q4.kv_bytes
    between = plan(smollm2, _device((f16.total_bytes + q8.total_bytes) // 2), ctx=8192)
    assert between.fits and between.kv_cache_type == "q8_0" and between.flash_attn
    lower = plan(smollm2, _device((q8.total_bytes + q4.total_bytes) // 2), ctx=8192)
    assert lower.fits and lower.kv_cache_type == "q4_0"
    assert lower.llama_kwargs()["type_k"] == lower.llama_kwargs()["type_v"] == KV_CACHE_TYPES["q4_0"]


def test_3b_model_on_a_small_budget_does_not_fit_and_says_why() -> None:
    p = plan("llama-3.2-3b-instruct-q4", _device(1 * GiB, "watch-1gb"))
    assert isinstance(p, MemoryPlan) and not p.fits
    assert "smaller model" in p.reason and "watch-1gb" in p.reason
    p = plan("phi-3-mini-4k-instruct-q4", "phone-8gb")
    assert p.fits and p.n_ctx == 4096


def test_context_beyond_training_does_not_fit(smollm2: Path) -> None:
    p = plan(smollm2, _device(8 * GiB), ctx=16384)
    assert not p.fits and "8192" in p.reason


@pytest.mark.parametrize("ctx", [0, -1, 1.5, "2048", True])
def test_bad_ctx_is_invalid_request(smollm2: Path, ctx: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        plan(smollm2, _device(4 * GiB), ctx=ctx)  # type: ignore[arg-type]
    assert info.value.param == "ctx"


def test_bad_cache_type_and_device_are_invalid_requests(smollm2: Path) -> None:
    with pytest.raises(InvalidRequestError, match="kv_cache_type"):
        plan(smollm2, _device(4 * GiB), kv_cache_type="q2_k")
    with pytest.raises(InvalidRequestError, match="phone-8gb"):
        plan(smollm2, "toaster")


def test_gpu_profiles_offload_layers(smollm2: Path) -> None:
    assert plan(smollm2, "phone-8gb").gpu_layers == 0
    mac = plan(smollm2, "mac-16gb")
    assert mac.gpu_layers == 30 and mac.llama_kwargs()["n_gpu_layers"] == 30


def test_llama_kwargs_are_what_llama_cpp_takes(smollm2: Path) -> None:
    kw = plan(smollm2, _device(4 * GiB), ctx=1024).llama_kwargs()
    assert kw["n_ctx"] == 1024 and kw["n_ubatch"] == kw["n_batch"] == 512
    assert kw["flash_attn"] is True and kw["use_mmap"] is False and kw["logits_all"] is False
    assert kw["type_k"] == kw["type_v"] == 1  # GGML_TYPE_F16


# --- against llama.cpp itself --------------------------------------------------------------

_KV_LOG = """
import json, sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], verbose=True, **json.loads(sys.argv[2]))
"""


def _llama_log(path: Path, kwargs: dict) -> str:
    pytest.importorskip("llama_cpp")
    proc = subprocess.run([sys.executable, "-c", _KV_LOG, str(path), json.dumps(kwargs)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr


@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
def test_kv_bytes_match_what_llama_cpp_allocates(smollm2: Path, cache_type: str) -> None:
    p = plan(smollm2, _device(4 * GiB), ctx=1000, kv_cache_type=cache_type)
    log = _llama_log(smollm2, p.llama_kwargs())
    match = re.search(r"llama_kv_cache:\s+\S+\s+KV buffer size\s*=\s*([\d.]+) MiB", log)
    assert match, log[-3000:]
    assert abs(float(match.group(1)) * MiB - p.kv_bytes) <= 0.01 * MiB


def _load_bench():
    if str(BENCH.parent) not in sys.path:
        sys.path.insert(0, str(BENCH.parent))  # for the benchmarks' shared _common module
    spec = importlib.util.spec_from_file_location("memory_accuracy", BENCH)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_plan_matches_measured_rss_of_smollm2(smollm2: Path) -> None:
    pytest.importorskip("llama_cpp")
    bench = _load_bench()
    p = plan(smollm2, "this", ctx=1024)
    measured = bench.measure(smollm2, 1024, timeout=600)["peak_rss"]  # through LlamaCppBackend
    assert abs(p.total_bytes / measured - 1) <= 0.15, (p.to_dict(), measured)
