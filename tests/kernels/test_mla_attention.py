"""MLA attention over the latent KV cache (kernels.mla_decode, kernels.mla_cache) against float64 references.

Every batch mixes the query shapes the engine produces: decodes (one token), prefill chunks after a cached
prefix, a whole prompt, and speculative verification (1 + k tokens), over blocks scattered in a shuffled
pool, with the output poisoned with NaN first. The cases marked `interpret` run on the CPU under
TRITON_INTERPRET=1: small latent sizes, and the real 512 + 64 at short contexts in float32 and float16 (whose
tiles are bfloat16's: tools/compile_sm90.py compiles what they launch); the rest need the GPU.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import cases  # noqa: E402

pytestmark = pytest.mark.gpu
interpret = pytest.mark.interpret

# DeepSeek-V2/V3: kv_lora_rank + qk_rope_head_dim; softmax scale 1 / sqrt(qk_nope + qk_rope) = 1 / sqrt(192).
REAL = (512, 64)
REAL_SCALE = 192**-0.5


@dataclass
class MlaCase:
    query: torch.Tensor  # [num_tokens, num_heads, latent_dim + rope_dim]
    cache: torch.Tensor  # [num_blocks, block_size, latent_dim + rope_dim]
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    query_start_loc: list[int]
    seq_lens: list[int]
    latent_dim: int
    scale: float


def make_case(q_lens, context_lens, num_heads, dims, block_size, dtype, device, seed=0, scale=None,
              cache_dtype=None) -> MlaCase:
    g = torch.Generator().manual_seed(seed)
    latent_dim, rope_dim = dims
    seq_lens = [c + q for c, q in zip(context_lens, q_lens)]
    needed = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.randint(0, num_blocks, (len(q_lens), max(needed) + 1), generator=g, dtype=torch.int32)
    used = 0
    for i, n in enumerate(needed):
        block_table[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    cache = torch.randn((num_blocks, block_size, latent_dim + rope_dim), generator=g)
    query = torch.randn((sum(q_lens), num_heads, latent_dim + rope_dim), generator=g)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    return MlaCase(query.to(dtype).to(device), cache.to(cache_dtype or dtype).to(device), block_table.to(device),
                   qsl, seq_lens, latent_dim, (latent_dim + rope_dim) ** -0.5 if scale is None else scale)


def run_case(case: MlaCase, num_splits=None, decode_config=None, prefill_config=None, k_scale=None) -> float:
    """Decode kernel for the one-token requests, the causal kernel for the rest; relative error of all rows."""
    from tokenmill.kernels.mla_decode import mla_attention_ref, mla_decode_attention, mla_prefill_attention

    device = case.query.device
    q_lens = [b - a for a, b in zip(case.query_start_loc, case.query_start_loc[1:])]
    as_ids = lambda ids: torch.tensor(ids, dtype=torch.int32, device=device)
    qsl, seq_lens = as_ids(case.query_start_loc), as_ids(case.seq_lens)
    out = torch.full((*case.query.shape[:2], case.latent_dim), float("nan"), dtype=case.query.dtype, device=device)
    mla_decode_attention(case.query, case.cache, out, qsl, seq_lens, case.block_table,
                         as_ids([i for i, n in enumerate(q_lens) if n == 1]), case.scale, k_scale,
                         num_splits=num_splits, config=decode_config)
    mla_prefill_attention(case.query, case.cache, out, qsl, seq_lens, case.block_table,
                          as_ids([i for i, n in enumerate(q_lens) if n > 1]), max(q_lens), case.scale, k_scale,
                          config=prefill_config)
    ref = mla_attention_ref(case.query, case.cache, case.query_start_loc, case.seq_lens, case.block_table,
                            case.scale, case.latent_dim, k_scale)
    return cases.rel_error(out.cpu(), ref.cpu())


def skip_bf16_interpreted(device, dtype):
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the interpreter's tl.dot takes bfloat16's bits for integers")


# Decodes (one at a context of 0 new-block tokens), a prefill chunk after a prefix, a whole prompt, a 1 + 3 verify.
MIXED = ([1, 7, 1, 4, 9, 1], [45, 20, 0, 33, 0, 16])


# Fewer heads than a tile; more, not a multiple of it.
@interpret
@pytest.mark.parametrize("dtype,num_heads,num_splits", [(torch.float32, 4, 3), (torch.float32, 20, 1),
                                                        (torch.float16, 20, 3), (torch.float16, 4, 1)],
                         ids=["fp32-H4-split3", "fp32-H20", "fp16-H20-split3", "fp16-H4"])
def test_small_latent_mixed_batch(device, dtype, num_heads, num_splits):
    """The tiny models' sizes (kv_lora_rank 32, qk_rope 16): padded dims, masked heads, every query shape."""
    case = make_case(*MIXED, num_heads, (32, 16), 16, dtype, device, seed=num_heads)
    small = (1, 16, 16, 4, 1)  # BLOCK_T = 1 for the multi-token queries too
    assert run_case(case, num_splits) < cases.TOLERANCE[dtype]
    assert run_case(case, num_splits, prefill_config=small) < cases.TOLERANCE[dtype]


@interpret
@pytest.mark.parametrize("num_heads", [16, 40])  # V2-Lite's; two tiles of 32 heads (V3's tile), one partly masked
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_real_latent_short_contexts(device, dtype, num_heads):
    """kv_lora_rank 512 + qk_rope 64 with the default tiles (what the engine compiles), split and not."""
    case = make_case([1, 5, 1, 3], [40, 11, 0, 20], num_heads, REAL, 16, dtype, device, scale=REAL_SCALE)
    for num_splits in (1, 4):
        assert run_case(case, num_splits) < cases.TOLERANCE[dtype]


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_fp8_latent_cache(device, dtype):
    """An e4m3 cache: its scale on the scores and the output (V is the stored K); split and not."""
    from tokenmill.kernels.kv_fp8 import FP8_DTYPE

    case = make_case(*MIXED, 4, (32, 16), 16, dtype, device, seed=3, cache_dtype=FP8_DTYPE)
    k_scale = torch.tensor(0.37, device=device)
    for num_splits in (1, 3):
        assert run_case(case, num_splits, k_scale=k_scale) < cases.TOLERANCE[dtype]


@interpret
@pytest.mark.parametrize("dims", [(32, 16), REAL], ids=["small", "real"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, "fp8"], ids=str)
def test_write_latent_cache(device, dtype, dims):
    """Exact copy of [c_kv | k_pe] (c_kv and k_pe strided views of one projection) at the slots; padding not
    stored; fp8: quantized with k_scale as the torch path does."""
    from tokenmill.kernels.kv_fp8 import FP8_DTYPE
    from tokenmill.kernels.mla_cache import write_latent_cache, write_latent_cache_ref

    g = torch.Generator().manual_seed(0)
    num_tokens, block_size, width = 37, 16, sum(dims)
    num_blocks = num_tokens // block_size + 3
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.2] = -1
    act_dtype = torch.float32 if dtype == "fp8" else dtype
    cache_dtype = FP8_DTYPE if dtype == "fp8" else dtype
    latent = (3 * torch.randn((num_tokens, width + 8), generator=g)).to(act_dtype).to(device)
    c_kv, k_pe = latent[:, : dims[0]], latent[:, dims[0] : width]
    pool = torch.randn((num_blocks, block_size, width), generator=g).to(cache_dtype).to(device)
    expected = pool.clone()
    k_scale = torch.tensor(0.11, device=device)
    write_latent_cache(c_kv, k_pe, pool, slots.to(torch.int32).to(device), k_scale)
    write_latent_cache_ref(c_kv, k_pe, expected, slots.to(device), k_scale)
    assert torch.equal(pool.view(torch.uint8).cpu(), expected.view(torch.uint8).cpu())


@interpret
@pytest.mark.parametrize("qk_nope_head_dim", [16, 24], ids=["qk32", "qk40"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, "fp8"], ids=str)
def test_triton_backend_mla_forms(device, dtype, qk_nope_head_dim):
    """The Triton backend's forward_mla over a mixed step (tests/models/test_deepseek.py): the latent cache writer,
    the absorbed kernels for the decodes, a verification and a short chunk after a long prefix, and the expanded
    rows (a prompt, a chunk over its decompressed prefix) through kernels.prefill_attention at the tiny MLA sizes:
    keys [k_nope | k_pe] 32 or 40 wide (padded to 64 in the kernel, masked), values 24 wide zero-padded to them."""
    from tests.models.test_deepseek import run_mixed_mla_step
    from tokenmill.attention.triton_attn import TritonAttentionBackend

    tolerance = cases.TOLERANCE[torch.float32 if dtype == "fp8" else dtype]
    assert run_mixed_mla_step(TritonAttentionBackend(), dtype, device, qk_nope_head_dim) < tolerance


@interpret
def test_decode_configs_and_split_counts(tmp_path):
    """The table benchmarks/mla_decode.py --out writes: read back, keyed by heads, 16-bit and an fp8 cache apart;
    the split count fills whole waves of the tuned programs per SM (132 SMs), capped, never 0."""
    import json

    from tokenmill.kernels.fused_moe import nearest_bucket
    from tokenmill.kernels.kv_fp8 import FP8_DTYPE
    from tokenmill.kernels.mla_decode import (
        MAX_SPLITS,
        DecodeConfig,
        decode_config_path,
        decode_shape_key,
        load_decode_configs,
        splits_for,
    )

    path = decode_config_path("NVIDIA H200", tmp_path)
    assert path == tmp_path / "mla_decode_NVIDIA_H200.json"
    keys = {decode_shape_key(16, dtype, cache) for dtype in (torch.bfloat16, torch.float16, torch.float32)
            for cache in (dtype, FP8_DTYPE)}
    assert len(keys) == 4  # bf16 and fp16 share
    tuned = {decode_shape_key(16, torch.bfloat16, torch.bfloat16): {1: DecodeConfig((16, 32, 8, 4), 1.0),
                                                                     64: DecodeConfig((16, 32, 4, 3), 1.9394)}}
    path.write_text(json.dumps({"configs": {k: {str(b): c.to_json() for b, c in v.items()} for k, v in tuned.items()}}))
    loaded = load_decode_configs(path)
    assert loaded == tuned and load_decode_configs(tmp_path / "missing.json") == {}
    buckets = loaded[decode_shape_key(16, torch.float16, torch.float16)]
    assert nearest_bucket(buckets, 48).tiles == (16, 32, 4, 3) and nearest_bucket(buckets, 4).programs_per_sm == 1.0
    assert [splits_for(n, 1.9394 * 132) for n in (1, 32, 64, 65, 128, 256, 300)] == [MAX_SPLITS, 8, 4, 3, 2, 1, 1]


@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_deepseek_shapes_long_contexts(device, dtype, num_heads):
    """Contexts up to 4k: decodes (split by the automatic choice, and forced), a 300-token chunk after a 3k
    prefix, a 1 + 3 verify at 4k, a 500-token prompt."""
    if device == "cpu":
        pytest.skip("GPU shapes")
    case = make_case([1, 1, 1, 300, 4, 500, 1], [4095, 17, 2048, 3000, 4092, 0, 1000], num_heads, REAL, 16, dtype,
                     device, scale=REAL_SCALE)
    for num_splits in (None, 1, 16):
        assert run_case(case, num_splits) < cases.TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_batch_of_64_at_4k(device, dtype):
    """The benchmark's shape (DeepSeek-V2-Lite, batch 64, 4k context), block size 16."""
    if device == "cpu":
        pytest.skip("GPU shapes")
    case = make_case([1] * 64, [4096 - 1 - i for i in range(64)], 16, REAL, 16, dtype, device, scale=REAL_SCALE)
    assert run_case(case) < cases.TOLERANCE[dtype]


@pytest.mark.parametrize("config", [(16, 64, 8, 3), (32, 32, 8, 3), (64, 32, 8, 3), (16, 16, 4, 6), (16, 32, 4, 4)],
                         ids=lambda c: "H{}-N{}-w{}-s{}".format(*c))
def test_decode_tile_configs(device, config):
    """Tiles benchmarks/mla_decode.py sweeps (bfloat16; 64 heads a tile: wgmma), so its table is safe to use."""
    if device == "cpu":
        pytest.skip("GPU shapes")
    case = make_case([1] * 8, [3000 + 7 * i for i in range(8)], 128, REAL, 16, torch.bfloat16, device,
                     scale=REAL_SCALE)
    assert run_case(case, decode_config=config) < cases.TOLERANCE[torch.bfloat16]


def test_decode_is_capturable_in_a_cuda_graph(device):
    """No host syncs on the decode path (split and combine): replayed with new lengths, same answers."""
    if device == "cpu":
        pytest.skip("CUDA graphs")
    from tokenmill.kernels.mla_decode import mla_attention_ref, mla_decode_attention

    case = make_case([1] * 4, [100, 2000, 3000, 40], 16, REAL, 16, torch.bfloat16, device, scale=REAL_SCALE)
    qsl = torch.tensor(case.query_start_loc, dtype=torch.int32, device=device)
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32, device=device)
    ids = torch.arange(4, dtype=torch.int32, device=device)
    out = torch.empty((4, 16, 512), dtype=torch.bfloat16, device=device)
    run = lambda: mla_decode_attention(case.query, case.cache, out, qsl, seq_lens, case.block_table, ids,
                                       case.scale, num_splits=8)
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for lengths in ([3000, 17, 1, 2999], [1, 2, 3, 4]):
        seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        ref = mla_attention_ref(case.query, case.cache, case.query_start_loc, lengths, case.block_table,
                                case.scale, 512)
        assert cases.rel_error(out.cpu(), ref.cpu()) < cases.TOLERANCE[torch.bfloat16]
