"""Each Triton kernel against its float64 (attention) or same-dtype (elementwise) torch reference.

The cases marked `interpret` are the subset CI runs on the CPU under TRITON_INTERPRET=1 (`make test`): every
kernel and its main variants, small enough for the interpreter."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import cases  # noqa: E402

pytestmark = pytest.mark.gpu
interpret = pytest.mark.interpret

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (q_lens, context_lens): decode only, prefill only, chunked prefill after a cached prefix, and a mix.
BATCHES = {
    "decode": ([1, 1, 1, 1], [0, 17, 130, 301]),
    "prefill": ([7, 64, 129], [0, 0, 0]),
    "chunked": ([33, 1, 80], [48, 200, 17]),
    "mixed": ([1, 19, 1, 1, 150, 2], [63, 0, 1, 400, 35, 16]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# Under the interpreter: the mixed batch (decode and prefill kernels, chunked prefill), every head layout.
@pytest.mark.parametrize("batch", [pytest.param(b, marks=interpret) if b == "mixed" else b for b in BATCHES])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (16, 1)], ids=["mha", "gqa4", "mqa"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_paged_attention(device, dtype, batch, heads, head_dim):
    if device == "cpu" and (dtype == torch.bfloat16 or head_dim > 64):
        pytest.skip("the interpreter mishandles bfloat16 and is slow")
    q_lens, context_lens = BATCHES[batch]
    case = cases.make_paged_case(q_lens, context_lens, heads[0], heads[1], head_dim, 16, dtype, device, seed=0)
    assert cases.run_paged_attention(case) < cases.TOLERANCE[dtype]


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_splits", [1, 3, 16])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 37}, {"logits_soft_cap": 5.0},
                                     pytest.param({"sliding_window": 8, "logits_soft_cap": 1.0}, marks=interpret)],
                         ids=str)
def test_paged_attention_options(device, block_size, num_splits, options):
    dtype = torch.float16
    case = cases.make_paged_case([1, 40, 1, 3], [500, 70, 5, 90], 8, 2, 128 if device == "cuda" else 32,
                                 block_size, dtype, device, seed=block_size + num_splits)
    assert cases.run_paged_attention(case, num_splits=num_splits, **options) < cases.TOLERANCE[dtype]


@interpret
def test_paged_attention_split_relaunch(device):
    """Two split launches in a row on different data: the last split to arrive resets its arrival counter, so
    the second launch combines too (an unreset counter never reaches num_splits - 1: its rows stay NaN)."""
    from tokenmill.kernels import arrivals as module

    dtype = torch.float16
    for seed, context_lens in enumerate([[300, 2, 90], [45, 260, 7, 0]]):
        case = cases.make_paged_case([1] * len(context_lens), context_lens, 8, 2, 128 if device == "cuda" else 32,
                                     16, dtype, device, seed=seed)
        assert cases.run_paged_attention(case, num_splits=5) < cases.TOLERANCE[dtype]
        assert not any(counters.any() for counters in module._arrival_buffers[case.query.device])


def test_paged_attention_many_splits(device):
    """40 requests x 8 KV heads x 16 splits, short contexts among them (splits with nothing to do)."""
    dtype = torch.float16
    context_lens = torch.randint(0, 400, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    case = cases.make_paged_case([1] * 40, context_lens, 16, 8, 128 if device == "cuda" else 32, 16, dtype,
                                 device, seed=3)
    assert cases.run_paged_attention(case, num_splits=16) < cases.TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 64), pytest.param((37, 8, 128), marks=interpret), (300, 4, 256)])
def test_reshape_and_cache(device, dtype, shape):
    assert cases.run_reshape_and_cache(*shape, 16, dtype, device, seed=0) == 0.0


@interpret
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm(device, dtype, residual, offset):
    tol = 1e-6 if dtype == torch.float32 else cases.TOLERANCE[dtype]
    assert cases.run_rms_norm(33, 1000, dtype, device, 0, residual, offset) < tol
    assert cases.run_rms_norm(7, 128, dtype, device, 1, False, offset, heads=4) < tol


@interpret
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary(device, dtype, rotary_dim):
    tol = 1e-6 if dtype == torch.float32 else cases.TOLERANCE[dtype]
    assert cases.run_rotary(19, 8, 2, 64, rotary_dim, dtype, device, 0) < tol


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm_offset", [None, 0.0, 1.0], ids=["no_norm", "qk_norm", "qk_norm_offset"])
# (heads, kv_heads, head_dim, rotary_dim): GQA with a full rotary, MHA rotating 3/4 of each head, MQA half.
@pytest.mark.parametrize("shape", [pytest.param((8, 2, 64, 64), marks=interpret), (8, 8, 128, 96), (16, 1, 256, 128)],
                         ids=str)
@pytest.mark.parametrize("heads_per_program", [1, 4], ids=["head_per_program", "heads_per_program"])
def test_qk_norm_rope_cache(device, dtype, norm_offset, shape, heads_per_program):
    num_tokens = 37 if device == "cuda" else 13  # a program per token and head(s): few under the interpreter
    mismatches, error = cases.run_qk_norm_rope_cache(num_tokens, *shape, norm_offset, dtype, device, seed=0,
                                                     heads_per_program=heads_per_program)
    # The rotary rounds each product and sum as torch does (no fused multiply-adds); Triton's interpreter
    # truncates float32 to bfloat16 instead of rounding it, so there bfloat16 can only be close.
    if norm_offset is None and (device == "cuda" or dtype != torch.bfloat16):
        assert mismatches == 0
    assert error < (1e-6 if dtype == torch.float32 else cases.TOLERANCE[dtype])


@interpret
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(device, dtype):
    tol = 1e-6 if dtype == torch.float32 else cases.TOLERANCE[dtype]
    assert cases.run_silu_and_mul(9, 1000, dtype, device, 0) < tol


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, pytest.param(5, marks=interpret), 16])
@pytest.mark.parametrize("config", [None, (32, 128, 4, 2), (32, 128, 4, 2, 3), (64, 256, 4, 3, 4)],
                         ids=["tuned", "small_tiles", "3_splits", "4_splits"])
def test_skinny_gemm(device, dtype, rows, config):
    from tokenmill.kernels.skinny_gemm import skinny_gemm, skinny_gemm_ref

    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the interpreter's tl.dot takes bfloat16's bits for integers")

    g = torch.Generator().manual_seed(rows)
    # n and k not multiples of the tiles (masked edges); x a strided view, as the rows of a wider output are.
    # Under the interpreter a quarter of each (the same tuned tiles).
    n, k = (4096 + 40, 4096 + 72) if device == "cuda" else (1024 + 40, 1024 + 72)
    x = torch.randn(rows, k + 24, generator=g).to(dtype).to(device)[:, :k]
    weight = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype).to(device)
    assert cases.rel_error(skinny_gemm(x, weight, config), skinny_gemm_ref(x, weight)) < cases.TOLERANCE[dtype]


def test_linear_takes_the_skinny_gemm_only_where_it_applies(device):
    from tokenmill.kernels.skinny_gemm import skinny_gemm_applies

    w = torch.empty(4096, 4096, dtype=torch.bfloat16, device=device)
    assert skinny_gemm_applies(torch.empty(16, 4096, dtype=torch.bfloat16, device=device), w)
    assert not skinny_gemm_applies(torch.empty(17, 4096, dtype=torch.bfloat16, device=device), w)  # a prefill
    assert not skinny_gemm_applies(torch.empty(1, 4096, device=device), w.float())  # float32: cuBLAS, exact
    small = torch.empty(1024, 4096, dtype=torch.bfloat16, device=device)  # too few tiles to fill the GPU
    assert not skinny_gemm_applies(torch.empty(1, 4096, dtype=torch.bfloat16, device=device), small)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the LM head takes the skinny GEMM on CUDA only")
def test_the_lm_head_takes_the_skinny_gemm_at_decode_rows():
    """Llama-3's LM head (128,256 x 4,096, bf16): a decode step's rows are the skinny GEMM's output, bit for bit,
    and close to cuBLAS's; a prefill's 17 rows stay cuBLAS's."""
    from tokenmill.kernels.skinny_gemm import skinny_gemm
    from tokenmill.layers.embedding import ParallelLMHead

    head = ParallelLMHead(128256, 4096).to(device="cuda", dtype=torch.bfloat16)
    head.weight.data.normal_(0, 4096**-0.5)
    for rows in (1, 16, 17):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        logits = head.compute_logits(x)
        cublas = torch.nn.functional.linear(x, head.weight)
        if rows <= 16:
            assert torch.equal(logits, skinny_gemm(x, head.weight))
            assert cases.rel_error(logits, cublas) < cases.TOLERANCE[torch.bfloat16]
        else:
            assert torch.equal(logits, cublas)


@interpret
def test_tree_attention_sees_each_node_s_ancestors_only(device):
    """Draft-tree masks (spec/tree.py) in the prefill kernel: a verify run (root and 6 nodes after a context), an
    EAGLE head's level pass (the last 3 of 6 nodes), one node alone (a single query: still the prefill kernel)
    and a plain prompt chunk. Each tree query's row equals causal attention over the context and its own path,
    gathered into a request of their own (the reference knows nothing of trees)."""
    from tokenmill.config import parse_token_tree
    from tokenmill.kernels.prefill_attention import paged_attention_ref, prefill_attention
    from tokenmill.spec.tree import TokenTree

    tree = TokenTree.from_paths(parse_token_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]))
    n = tree.num_nodes
    dtype = torch.float32
    # (queries, keys before the queries, tree nodes at the end of the keys)
    requests = [(1 + n, 37, n), (3, 20 + n - 3, n), (1, 9 + 5, 5), (12, 5, 0)]
    case = cases.make_paged_case([q for q, _, _ in requests], [c for _, c, _ in requests], 4, 2, 32, 16, dtype,
                                 device, seed=3)
    bits = []  # query j of a request is node tree_len - q_len + j (the queries before the nodes: any bits)
    for q_len, _, tree_len in requests:
        bits += [int(tree.ancestor_bits[tree_len - q_len + j]) if 0 <= tree_len - q_len + j else -1
                 for j in range(q_len)]
    qsl, seq_lens = case.tensors()
    tree_lens = torch.tensor([t for _, _, t in requests], dtype=torch.int32, device=device)
    tree_bits = torch.tensor(bits, dtype=torch.int64, device=device)
    out = torch.full_like(case.query, float("nan"))
    prefill_attention(case.query, case.kv_cache, out, qsl, seq_lens, case.block_table,
                      torch.arange(len(requests), dtype=torch.int32, device=device), 1 + n, case.scale,
                      tree_lens=tree_lens, tree_bits=tree_bits)
    ref = paged_attention_ref(case.query, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_table,
                              case.scale, tree_lens=tree_lens.tolist(), tree_bits=tree_bits)
    assert cases.rel_error(out, ref) < cases.TOLERANCE[dtype]
    # The independent reference: each tree query alone, over its context and path laid out as a plain sequence.
    block_size = case.kv_cache.shape[2]
    flat_kv = case.kv_cache.flatten(1, 2)  # [2, num_blocks * block_size, kv_heads, head_dim]
    for r, (q_len, context, tree_len) in enumerate(requests):
        seq_len = context + q_len
        slots = [int(case.block_table[r, p // block_size]) * block_size + p % block_size for p in range(seq_len)]
        for j in range(q_len):
            query_index = case.query_start_loc[r] + j
            node = tree_len - q_len + j  # its index among the tree nodes
            if tree_len == 0 or node < 0:
                continue
            seen = list(range(seq_len - tree_len)) + [seq_len - tree_len + a for a in range(node + 1)
                                                      if tree.ancestor_bits[node] >> a & 1]
            pool = flat_kv[:, [slots[p] for p in seen]].unsqueeze(2)  # one token per block
            alone = paged_attention_ref(case.query[query_index : query_index + 1], pool, [0, 1], [len(seen)],
                                        torch.arange(len(seen), device=device)[None], case.scale)
            assert cases.rel_error(out[query_index : query_index + 1], alone) < cases.TOLERANCE[dtype], (r, j)
