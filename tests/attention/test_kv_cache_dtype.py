"""16-bit KV caches (kv_cache_dtype "bfloat16" / "float16") under fp32 attention.

A 16-bit cache changes what is stored, not how attention computes: every path (the C decode
kernel, SDPA decodes with V1_CPU_KERNELS=0, prefills with context, the cascade, sliding
windows, the reference) widens the stored values to fp32 exactly and computes as before. So
on K/V that are already 16-bit values it gives the fp32 cache's result bit for bit, and on
any K/V it stays within the 16-bit rounding of the fp32 answer. The engine option, its
spellings, the block count (twice the blocks for the same memory), the cache tensors' dtype,
a greedy run of the real model, and the Triton kernels (16-bit cache, fp32 queries). Both
backends' writes into fp16 saturate at +-65504 (an inf key would make attention NaN).
"""


import pytest
import torch

from tests.attention.test_torch_attn import GQA, SCENARIOS, Batch
from v1.attention.backends import torch_plan
from v1.attention.backends.abstract import kv_cache_shape
from v1.attention.backends.torch_attn import (
    paged_attention_reference,
    write_kv_cache,
)
from v1.attention.backends.torch_plan import AttentionPlan
from v1.config import KV_CACHE_DTYPES, CacheConfig, EngineArgs, SchedulerConfig
from v1.entrypoints.llm import LLM
from v1.kernels.attention import paged_decode_kernel
from v1.sampling_params import SamplingParams
from v1.worker.model_runner import _DEFAULT_CPU_KV_CACHE_BYTES, ModelRunner

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
# |16-bit-cache output - fp32 output| on unrounded K/V: each K/V value is off by up to 2^-9
# (bf16) or 2^-12 (fp16) relatively; outputs here are O(1).
HALF_ATOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}


@pytest.fixture(params=["native", "sdpa"])
def path(request, monkeypatch):
    """Decodes and short prefills through the C kernel, or everything through torch."""
    if request.param == "sdpa":
        monkeypatch.setenv("V1_CPU_KERNELS", "0")
    for name in ("MIN_CASCADE_SAVING", "MIN_CASCADE_SAVING_NATIVE"):
        monkeypatch.setattr(torch_plan, name, 0)  # cascade the short prefixes
    return request.param


def round_kv(batch: Batch, dtype: torch.dtype) -> None:
    """Make every K/V value of the batch (cached and new) a `dtype` value, kept in fp32."""
    def r(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype).float()

    batch.kv_cache, batch.key, batch.value = r(batch.kv_cache), r(batch.key), r(batch.value)
    batch.full_k = [r(k) for k in batch.full_k]
    batch.full_v = [r(v) for v in batch.full_v]


def check_kernel_serves(batch: Batch, cache: torch.Tensor, path: str, window: int | None):
    """Under "native", the step's decodes go to the C kernel for this 16-bit cache (where
    the library has one); under "sdpa", to torch."""
    plan = AttentionPlan.for_step(batch.metadata, cache, batch.query.shape[1], window)
    if path == "sdpa":
        assert plan.native is None
        return
    if paged_decode_kernel(torch.zeros(kv_cache_shape(1, 16, 1, 64)), 1) is None:
        pytest.skip("no C kernels here (V1_CPU_KERNELS=0?)")
    if paged_decode_kernel(torch.zeros(kv_cache_shape(1, 16, 1, 64), dtype=cache.dtype),
                           1) is None:
        pytest.skip("no kernel for this cache dtype in this library (fp16 needs F16C)")
    assert plan.native is not None or not any(q == 1 for q, _, _ in batch.reqs)


@pytest.mark.parametrize("dtype", list(HALF.values()), ids=list(HALF))
@pytest.mark.parametrize("window", [None, 7], ids=["global", "window7"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_half_cache_equals_fp32_cache_on_rounded_kv(scenario, window, dtype, path):
    """On 16-bit-valued K/V, a 16-bit cache gives exactly the fp32 cache's output and
    stores the same values, on every path and in the reference."""
    reqs, prefixes = SCENARIOS[scenario]
    num_heads, num_kv_heads = GQA["gqa3"]
    batch = Batch(reqs, prefixes, num_heads, num_kv_heads, 64, 16, seed=1)
    round_kv(batch, dtype)
    scale = 64**-0.5
    out32, cache32 = batch.run_fast(scale, window)
    half = batch.kv_cache.to(dtype)
    check_kernel_serves(batch, half, path, window)
    out16, cache16 = batch.run_fast(scale, window, kv_cache=half)
    assert cache16.dtype == dtype and out16.dtype == torch.float32
    assert torch.equal(cache16.float().nan_to_num(), cache32.nan_to_num())  # written once
    assert not out16.isnan().any()
    assert torch.equal(out16, out32)
    ref16 = paged_attention_reference(batch.query, cache16, batch.metadata, scale, window)
    ref32 = paged_attention_reference(batch.query, cache32, batch.metadata, scale, window)
    assert ref16.dtype == torch.float32 and torch.equal(ref16, ref32)


@pytest.mark.parametrize("dtype", list(HALF.values()), ids=list(HALF))
@pytest.mark.parametrize("window", [None, 7], ids=["global", "window7"])
@pytest.mark.parametrize("scenario", ["mixed", "chunked", "shared-decode", "long-prefills"])
def test_half_cache_close_to_fp32_on_any_kv(scenario, window, dtype, path):
    """On unrounded K/V the 16-bit cache's output stays within 16-bit rounding of exact
    (float64) attention, and is not the fp32 cache's output (the values were rounded)."""
    reqs, prefixes = SCENARIOS[scenario]
    batch = Batch(reqs, prefixes, 9, 3, 64, 16, seed=2)
    scale = 64**-0.5
    check_kernel_serves(batch, batch.kv_cache.to(dtype), path, window)
    out16, _ = batch.run_fast(scale, window, kv_cache=batch.kv_cache.to(dtype))
    out32, _ = batch.run_fast(scale, window)
    dense = batch.dense(scale, window)
    torch.testing.assert_close(out16.double(), dense, atol=HALF_ATOL[dtype], rtol=0)
    torch.testing.assert_close(out32.double(), dense, atol=2e-5, rtol=1e-5)
    assert (out16 - out32).abs().max() > 1e-5


@pytest.mark.parametrize("scenario", ["decode", "mixed", "chunked"])
def test_fp16_cache_saturates_out_of_range_kv(scenario, path):
    """K/V beyond fp16's range are stored as +-65504 (saturated, as vLLM's fp8 cache writes
    are), not as inf, which would make the softmax, and the output, NaN; NaN stays NaN. The
    same on the write with padding slots."""
    reqs, prefixes = SCENARIOS[scenario]
    batch = Batch(reqs, prefixes, 9, 3, 64, 16, seed=4)
    batch.key[:, 0, 0] = 1e5
    batch.value[:, 1, 2] = -1e6
    out, cache = batch.run_fast(64**-0.5, kv_cache=batch.kv_cache.to(torch.float16))
    assert not out.isnan().any()
    written = cache.view(2, -1, 3, 64)[:, batch.metadata.slot_mapping]
    assert (written[0, :, 0, 0] == 65504).all() and (written[1, :, 1, 2] == -65504).all()

    cache = torch.zeros(kv_cache_shape(2, 16, 1, 8), dtype=torch.float16)
    kv = torch.tensor([1e5, -7e4, float("nan"), 1.5]).view(4, 1, 1).expand(4, 1, 8)
    write_kv_cache(kv, -kv, cache, torch.tensor([3, -1, 5, 17]))
    k, v = cache.view(2, -1, 1, 8)[:, [3, 5, 17], 0, 0]
    assert k[0] == 65504 and k[1].isnan() and k[2] == 1.5 and v[0] == -65504


# ---- the option, the pool ----------------------------------------------------------------------


def test_kv_cache_dtype_option():
    for spelling, name in KV_CACHE_DTYPES.items():
        assert EngineArgs(kv_cache_dtype=spelling).kv_cache_dtype == spelling
        assert CacheConfig(cache_dtype=spelling).cache_dtype == name
    _, cache_config = EngineArgs(kv_cache_dtype="bf16").create_configs(2048, on_gpu=False)
    assert cache_config.cache_dtype == "bfloat16"
    assert CacheConfig().cache_dtype == "auto"
    for bad in ("fp8", "fp8_e4m3", "int8", "half"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype must be one of auto, .*'{bad}'"):
            EngineArgs(kv_cache_dtype=bad)
        with pytest.raises(ValueError, match="bfloat16, bf16, float16, fp16"):
            CacheConfig(cache_dtype=bad)


def test_kv_cache_dtype_flag():
    from v1.entrypoints.openai.api_server import engine_args_from, make_parser

    parser = make_parser()
    args = engine_args_from(parser, parser.parse_args(["--kv-cache-dtype", "bf16"]))
    assert args.kv_cache_dtype == "bf16"
    with pytest.raises(SystemExit):  # the parser's error: exit status 2, the message
        engine_args_from(parser, parser.parse_args(["--kv-cache-dtype", "fp8"]))


@pytest.mark.parametrize("cache_dtype", ["bf16", "fp16", "fp32", "auto"])
def test_half_cache_holds_twice_the_blocks(default_model, cache_dtype):
    """The pool is sized by the cache's element size: a 16-bit cache gets twice the blocks
    of the same memory (the default budget or a given one), stored in that dtype."""
    def runner(kv_cache_memory: int | None) -> tuple[ModelRunner, int]:
        config = CacheConfig(kv_cache_memory=kv_cache_memory, cache_dtype=cache_dtype)
        runner = ModelRunner(default_model, SchedulerConfig(max_num_seqs=4, max_model_len=64),
                             config, torch.device("cpu"), torch.float32)
        return runner, runner.determine_num_blocks(config)

    cfg = default_model.hf_config
    fp32_block = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * 16
    factor = 2 if cache_dtype in HALF else 1
    default, num_blocks = runner(None)
    assert default.kv_cache_block_bytes() * factor == fp32_block
    assert num_blocks == _DEFAULT_CPU_KV_CACHE_BYTES // (fp32_block // factor)
    small, num_blocks = runner(64 << 20)
    assert num_blocks == (64 << 20) // (fp32_block // factor)
    small.initialize_kv_cache(num_blocks)
    expected = HALF.get(cache_dtype, torch.float32)
    assert all(t.dtype == expected for t in small.kv_caches)
    assert sum(t.nbytes for t in small.kv_caches) == num_blocks * small.kv_cache_block_bytes()


PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three colors of the rainbow:",
]


def test_real_model_greedy_with_half_caches(default_model):
    """The default model through the engine with each cache dtype, greedy: the 16-bit
    caches are bf16 / fp16 tensors with twice the blocks, and their tokens stay (almost) the
    fp32 cache's. The accuracy gates over more prompts are bench/bench_quant.py's."""
    params = SamplingParams(temperature=0, max_tokens=24)
    tokens, pools = {}, {}
    for cache_dtype in ("auto", "bf16", "fp16"):
        with LLM(loaded_model=default_model, kv_cache_dtype=cache_dtype,
                 kv_cache_memory=64 << 20, max_model_len=512) as llm:
            core = llm.llm_engine.client.engine_core
            caches = core.model_runner.kv_caches
            pools[cache_dtype] = (core.scheduler.kv_cache_manager.num_blocks, caches[0].dtype)
            outputs = llm.generate(PROMPTS, params, use_tqdm=False)
            tokens[cache_dtype] = [o.outputs[0].token_ids for o in outputs]
    num_blocks = pools["auto"][0]
    assert pools == {"auto": (num_blocks, torch.float32),
                     "bf16": (2 * num_blocks, torch.bfloat16),
                     "fp16": (2 * num_blocks, torch.float16)}
    for cache_dtype in HALF:
        same = [
            sum(a == b for a, b in zip(ours, ref)) / len(ref)
            for ours, ref in zip(tokens[cache_dtype], tokens["auto"], strict=True)
        ]
        assert sum(same) / len(same) >= 0.9, (cache_dtype, same)


# ---- Triton: 16-bit caches under fp32 queries ---------------------------------------------------


@pytest.mark.parametrize("dtype", list(HALF.values()), ids=list(HALF))
def test_triton_half_cache_fp32_queries(dtype):
    """The Triton kernels take a 16-bit cache beside fp32 activations as they are: the
    write casts to the cache's dtype on store, attention casts the query to it on load and
    writes fp32. (In the interpreter, fp16 only: it has no bf16 tl.dot.)"""
    from tests.attention import test_triton_attention as tt

    if tt.DEVICE == "cpu" and not tt.INTERPRETED:
        pytest.skip("no GPU and the kernels were imported without TRITON_INTERPRET=1")
    if tt.INTERPRETED and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter does not support tl.dot on bfloat16")
    batch = tt.make_batch(tt.MIXED, 6, 2, 64, 16, seed=6, device=tt.DEVICE)
    half = batch.kv_cache.to(dtype)
    out = tt.run_triton(batch, 0.125, kv_cache=half)
    assert out.dtype == torch.float32
    tt.reshape_and_cache(batch.key, batch.value, half, batch.metadata.slot_mapping)
    # The reference on the same 16-bit K/V in fp32; the query and P are rounded to `dtype`
    # for the dots in the kernel (as a 16-bit model's).
    round_kv(batch, dtype)
    expected = batch.kv_cache.clone()
    tt.write_kv_cache(batch.key, batch.value, expected, batch.metadata.slot_mapping)
    assert half.dtype == dtype and torch.equal(half.float().nan_to_num(), expected.nan_to_num())
    torch.testing.assert_close(out.cpu(), tt.reference(batch, 0.125), atol=1e-2, rtol=1e-2)


def test_triton_fp16_cache_saturates_out_of_range_kv():
    """The Triton write stores K/V beyond fp16's range as +-65504, as the torch write does
    (from an fp32 or a bf16 model); NaN stays NaN."""
    from tests.attention import test_triton_attention as tt

    if tt.DEVICE == "cpu" and not tt.INTERPRETED:
        pytest.skip("no GPU and the kernels were imported without TRITON_INTERPRET=1")
    for dtype in (torch.float32, torch.bfloat16):
        kv = torch.tensor([1e5, -7e4, float("nan"), 1.5], dtype=dtype).view(4, 1, 1)
        kv = kv.expand(4, 1, 8).contiguous().to(tt.DEVICE)
        cache = torch.zeros(kv_cache_shape(2, 16, 1, 8), dtype=torch.float16, device=tt.DEVICE)
        tt.reshape_and_cache(kv, -kv, cache, torch.tensor([3, -1, 5, 17], device=tt.DEVICE))
        k, v = cache.view(2, -1, 1, 8)[:, [3, 5, 17], 0].cpu()
        assert (k[0] == 65504).all() and k[1].isnan().all() and (k[2] == 1.5).all(), dtype
        assert (v[0] == -65504).all(), dtype
