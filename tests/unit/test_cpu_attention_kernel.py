"""The CPU attention C kernel against the float64 reference and the torch path: decodes, prefills,
chunks and multi-token queries after a cached context (speculative verification), draft trees' masks, sliding
windows, soft-capping, grouped heads, both storage dtypes; NaN in every pool slot no request owns."""

import math
import platform

import numpy as np
import pytest
import torch

from tokenmill.attention import cpu_kernel
from tokenmill.attention.backend import BatchLayout
from tokenmill.attention.cpu_kernel import kernel_applies, load_kernel, paged_attention_cpu
from tokenmill.attention.torch_attn import TorchAttentionBackend, paged_attention_torch, write_kv
from tokenmill.config import parse_token_tree
from tokenmill.cpu_compile import FLAGS, cpu_signature
from tokenmill.kernels.prefill_attention import paged_attention_ref
from tokenmill.layers.attention import Attention
from tokenmill.spec.tree import TokenTree

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no C compiler: the backend uses the torch path")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative to the float64 reference's norm


def make_case(q_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """Requests with `context_lens` cached tokens before their `q_lens` new ones, their blocks shuffled
    over a pool whose other slots hold NaN."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, q_lens)]
    blocks_needed = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 5
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.zeros(len(q_lens), max(blocks_needed) + 2, dtype=torch.int64)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    used = 0
    for i, (n, seq_len) in enumerate(zip(blocks_needed, seq_lens)):
        block_table[i, :n] = perm[used : used + n]
        used += n
        for pos in range(seq_len):
            block = block_table[i, pos // block_size]
            kv_cache[:, block, pos % block_size] = torch.randn(2, num_kv_heads, head_dim, generator=g).to(dtype)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).tolist()
    return query, kv_cache, block_table, qsl, seq_lens


def rel_error(out, ref):
    assert torch.isfinite(out).all()
    return ((out.double() - ref).norm() / ref.norm()).item()


# (new tokens, cached tokens) per request
SHAPES = {
    "decodes": ([1, 1, 1, 1], [0, 5, 16, 70]),
    "prefills": ([7, 16, 33], [0, 0, 0]),
    "chunks_after_cache": ([9, 20], [40, 17]),
    "verify_1_plus_k": ([5, 3, 1, 4], [30, 64, 12, 0]),  # 1 + k tokens after a cached context
    # TREE's root and 6 nodes after a context, an EAGLE head's level pass (the last 3 nodes), node 4 alone (tree
    # nodes 0-4 end its keys), a plain chunk beside them
    "verify_trees": ([7, 3, 1, 12], [30, 17, 14, 5]),
}
TREE = TokenTree.from_paths(parse_token_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]))
TREE_LENS = {"verify_trees": [6, 6, 5, 0]}  # the tree nodes ending each request's keys


def tree_bits_of(q_lens: list[int], tree_lens: list[int]) -> list[int]:
    """Each query's ancestor bits: a request's query j is node tree_len - q_len + j of TREE; the queries before
    the nodes see every node (causality hides them)."""
    return [int(TREE.ancestor_bits[tree_len - q_len + j]) if tree_len - q_len + j >= 0 else -1
            for q_len, tree_len in zip(q_lens, tree_lens) for j in range(q_len)]


def tree_args(shape: str) -> dict:
    """The shape's draft-tree masks as paged_attention_cpu takes them (none for shapes without trees)."""
    if shape not in TREE_LENS:
        return {}
    bits = tree_bits_of(SHAPES[shape][0], TREE_LENS[shape])
    return dict(tree_lens=torch.tensor(TREE_LENS[shape]), tree_bits=torch.tensor(bits))


def ref_tree(tree: dict) -> dict:
    """tree_args' masks as paged_attention_ref takes them."""
    return dict(tree_lens=tree["tree_lens"].tolist(), tree_bits=tree["tree_bits"]) if tree else {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("heads,head_dim", [((8, 2), 64), ((4, 4), 128), ((6, 1), 40)], ids=str)
@pytest.mark.parametrize("window,soft_cap", [(None, None), (13, None), (None, 20.0), (8, 5.0)], ids=str)
def test_kernel_equals_the_float64_reference(dtype, shape, heads, head_dim, window, soft_cap):
    q_lens, context_lens = SHAPES[shape]
    query, kv_cache, block_table, qsl, seq_lens = make_case(q_lens, context_lens, *heads, head_dim, 16, dtype)
    scale = head_dim**-0.5
    assert kernel_applies(query, kv_cache)
    tree = tree_args(shape)
    out = paged_attention_cpu(query, kv_cache, block_table, torch.tensor(qsl), torch.tensor(seq_lens), scale,
                              window, soft_cap, **tree)
    ref = paged_attention_ref(query, kv_cache, qsl, seq_lens, block_table, scale, window, soft_cap, **ref_tree(tree))
    assert rel_error(out, ref) < TOLERANCE[dtype]


# The kernel as built for other x86 CPUs than this one: AVX-512 without AVX512_BF16, and no AVX-512 at all
# (the portable loops), with the bits of kernel_paths() each build should report here.
OTHER_BUILDS = {
    "native": ((), lambda cpu: ("avx512f" in cpu) | ("avx512f" in cpu and "avx512_bf16" in cpu) << 1),
    "no_avx512_bf16": (("-mno-avx512bf16",), lambda cpu: int("avx512f" in cpu)),
    "no_avx512": (("-mno-avx512f",), lambda cpu: 0),
}


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 compiler flags")
@pytest.mark.parametrize("build", OTHER_BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_builds_for_other_cpus_equal_the_float64_reference(monkeypatch, build, dtype):
    extra_flags, expected_paths = OTHER_BUILDS[build]
    lib = load_kernel(tuple(FLAGS) + extra_flags)
    assert lib is not None, "gcc and clang take these flags on x86: the source does not build without AVX-512"
    assert lib.kernel_paths() == expected_paths(set(cpu_signature().split()))
    monkeypatch.setattr(cpu_kernel, "load_kernel", lambda: lib)
    # head sizes: whole 32-lane bfloat16 vectors, whole 16-lane float32 vectors only, neither
    for heads, head_dim in [((9, 3), 64), ((4, 2), 96), ((6, 1), 40)]:
        # (a window of 5 starts within the trees' 6 nodes)
        for shape, (window, soft_cap) in zip(SHAPES, [(None, None), (13, None), (None, 20.0), (8, 5.0), (5, None)]):
            q_lens, context_lens = SHAPES[shape]
            query, kv_cache, block_table, qsl, seq_lens = make_case(q_lens, context_lens, *heads, head_dim, 16, dtype)
            tree = tree_args(shape)
            out = paged_attention_cpu(query, kv_cache, block_table, torch.tensor(qsl), torch.tensor(seq_lens), 0.1,
                                      window, soft_cap, **tree)
            ref = paged_attention_ref(query, kv_cache, qsl, seq_lens, block_table, 0.1, window, soft_cap,
                                      **ref_tree(tree))
            assert rel_error(out, ref) < TOLERANCE[dtype], (heads, head_dim, shape)


@pytest.mark.parametrize("block_size", [8, 32])
def test_mixed_batch_with_other_block_sizes_and_strided_queries(block_size):
    # A decode, a prefill, a chunk after its cache: one batch, as the scheduler mixes them.
    query, kv_cache, block_table, qsl, seq_lens = make_case([1, 12, 6], [50, 0, 33], 4, 2, 64, block_size,
                                                            torch.float32, seed=3)
    # q as a slice of a fused qkv row: the kernel reads it through its token stride.
    qkv = torch.cat([query.flatten(1), torch.randn(len(query), 2 * 2 * 64)], dim=1)
    strided = qkv[:, : 4 * 64].view(-1, 4, 64)
    out = paged_attention_cpu(strided, kv_cache, block_table, torch.tensor(qsl), torch.tensor(seq_lens), 0.125)
    ref = paged_attention_ref(query, kv_cache, qsl, seq_lens, block_table, 0.125)
    assert rel_error(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("num_threads", [1, 2])
def test_many_requests_over_threads_equal_the_torch_path(num_threads):
    query, kv_cache, block_table, qsl, seq_lens = make_case([1] * 20 + [17], list(range(3, 63, 3)) + [9], 9, 3,
                                                            64, 16, torch.float32, seed=5)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out = paged_attention_cpu(query, kv_cache, block_table, torch.tensor(qsl), torch.tensor(seq_lens), 0.125)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(out, paged_attention_torch(query, kv_cache, block_table, qsl, seq_lens, 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_prompts_tokens_in_blocks_equal_each_token_alone(dtype):
    """The kernel takes a prompt's tokens in blocks that share each key tile; every token's arithmetic stays its
    own: bitwise what it gives as a request of one token over the same cache (blocks of 8 and a remainder)."""
    q_lens, contexts = [19, 1, 8], [5, 30, 0]
    query, kv_cache, block_table, qsl, seq_lens = make_case(q_lens, contexts, 9, 3, 64, 16, dtype, seed=7)
    out = paged_attention_cpu(query, kv_cache, block_table, torch.tensor(qsl), torch.tensor(seq_lens), 0.125)
    owner = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    alone_lens = torch.tensor([seq_lens[i] - (qsl[i + 1] - 1 - t) for t, i in enumerate(owner.tolist())])
    alone = paged_attention_cpu(query, kv_cache, block_table[owner], torch.arange(len(owner) + 1), alone_lens, 0.125)
    assert torch.equal(out, alone)


def make_layout(q_lens, context_lens, block_size, num_blocks, tree_lens=None):
    seq_lens = np.array([c + q for c, q in zip(context_lens, q_lens)], dtype=np.int32)
    max_blocks = -(-int(seq_lens.max()) // block_size)
    block_table = np.random.default_rng(0).permutation(num_blocks)[: len(q_lens) * max_blocks]
    block_table = block_table.reshape(len(q_lens), max_blocks).astype(np.int32)
    slots = [block_table[i, p // block_size] * block_size + p % block_size
             for i, (c, n) in enumerate(zip(context_lens, seq_lens.tolist())) for p in range(c, n)]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tree = {} if tree_lens is None else dict(tree_lens=np.array(tree_lens, dtype=np.int32),
                                             tree_bits=np.array(tree_bits_of(q_lens, tree_lens), dtype=np.int64))
    return BatchLayout(qsl, seq_lens, block_table, np.array(slots, dtype=np.int64), block_size, **tree)


# tree_lens: the root and nodes 0-2 of TREE after a context, node 1 alone (node 0, a sibling, hidden)
@pytest.mark.parametrize("window,soft_cap,tree_lens", [(None, None, None), (10, 30.0, None), (None, None, [0, 3, 2, 0]),
                                                       (10, 30.0, [0, 3, 2, 0])], ids=str)
def test_backend_forward_takes_the_kernel_and_equals_the_torch_path(monkeypatch, window, soft_cap, tree_lens):
    torch.manual_seed(1)
    q_lens, context_lens = [1, 4, 1, 9], [20, 11, 3, 0]
    layout = make_layout(q_lens, context_lens, 16, 32, tree_lens)
    kv_cache = torch.randn(2, 32, 16, 2, 64)
    num_tokens = sum(q_lens)
    query, key, value = torch.randn(num_tokens, 6, 64), torch.randn(num_tokens, 2, 64), torch.randn(num_tokens, 2, 64)
    layer = Attention(6, 64, 0.125, 2, sliding_window=window, logits_soft_cap=soft_cap)
    backend = TorchAttentionBackend()
    metadata = backend.build_metadata(layout, torch.device("cpu"))
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(context_lens, q_lens)])

    calls = []
    monkeypatch.setattr("tokenmill.attention.torch_attn.paged_attention_cpu",
                        lambda *args: calls.append(1) or paged_attention_cpu(*args))
    out = backend.forward(layer, positions, query, key, value, kv_cache.clone(), metadata)
    assert calls, "the CPU backend did not take the C kernel"

    # The fallback: as if no compiler were there.
    monkeypatch.setattr(cpu_kernel, "load_kernel", lambda: None)
    assert not kernel_applies(query, kv_cache)
    fallback = backend.forward(layer, positions, query, key, value, kv_cache.clone(), metadata)
    torch.testing.assert_close(out, fallback)

    written = kv_cache.clone()
    write_kv(written, key, value, metadata.slot_mapping)
    ref = paged_attention_ref(query, written, layout.query_start_loc.tolist(), layout.seq_lens.tolist(),
                              metadata.block_table, 0.125, window, soft_cap, tree_lens=metadata.tree_lens,
                              tree_bits=metadata.tree_bits)
    assert rel_error(out, ref) < TOLERANCE[torch.float32]


def test_kernel_declines_what_it_cannot_run():
    kv_cache = torch.zeros(2, 4, 16, 2, 64)
    assert not kernel_applies(torch.zeros(3, 4, 64, dtype=torch.float16), kv_cache.half())
    assert not kernel_applies(torch.zeros(3, 4, 64, dtype=torch.bfloat16), kv_cache)  # dtypes differ
    assert not kernel_applies(torch.zeros(3, 64, 4).transpose(1, 2), kv_cache)  # head dim not contiguous
    assert not kernel_applies(torch.zeros(3, 128, 64), kv_cache)  # over the kernel's 64 heads


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)], ids=str)
@pytest.mark.parametrize("partial_rotary_factor", [1.0, 0.5])
def test_fused_rope_and_cache_write_equals_transform_and_write(dtype, tol, partial_rotary_factor):
    from transformers import LlamaConfig

    from tokenmill.attention.cpu_kernel import rope_and_cache, rope_and_cache_applies
    from tokenmill.layers.rotary import RotaryEmbedding

    config = LlamaConfig(head_dim=64, max_position_embeddings=256, rope_theta=10000.0,
                         partial_rotary_factor=partial_rotary_factor)
    layer = Attention(6, 64, 0.125, 2, rotary_emb=RotaryEmbedding(config, 64, 256))
    g = torch.Generator().manual_seed(0)
    num_tokens = 11
    qkv = torch.randn(num_tokens, (6 + 2 + 2) * 64, generator=g).to(dtype)  # views of one fused row
    query, key, value = (t.view(num_tokens, -1, 64) for t in qkv.split([6 * 64, 2 * 64, 2 * 64], dim=-1))
    positions = torch.randint(0, 256, (num_tokens,), generator=g)
    slots = torch.randperm(8 * 16, generator=g)[:num_tokens]
    layer.kv_cache = torch.zeros(2, 8, 16, 2, 64, dtype=dtype)
    assert rope_and_cache_applies(layer, positions, key, value, max_seq_len=256)
    assert not rope_and_cache_applies(layer, positions, key, value, max_seq_len=257)  # past the table
    fused_cache = layer.kv_cache.clone()
    fused_query = rope_and_cache(layer, positions, query, key, value, fused_cache, slots)

    ref_query, ref_key = layer.transform_qk(positions, query.double(), key.double())
    ref_cache = torch.zeros(2, 8, 16, 2, 64, dtype=torch.float64)
    write_kv(ref_cache, ref_key, value.double(), slots)
    torch.testing.assert_close(fused_query.double(), ref_query, atol=tol, rtol=tol)
    torch.testing.assert_close(fused_cache.double(), ref_cache, atol=tol, rtol=tol)

    # rope_cache_attention: the write and paged_attention_cpu in one call, bit for bit (one request of 40 tokens,
    # the last 11 new, over the pool's blocks in a shuffled order)
    from tokenmill.attention.cpu_kernel import rope_cache_attention

    block_table, qsl, seq_lens = torch.randperm(8, generator=g)[None], torch.tensor([0, 11]), torch.tensor([40])
    one_call_cache = layer.kv_cache.clone()
    out = rope_cache_attention(layer, positions, query, key, value, one_call_cache, slots, block_table, qsl, seq_lens)
    assert torch.equal(one_call_cache, fused_cache)
    assert torch.equal(out, paged_attention_cpu(fused_query, fused_cache, block_table, qsl, seq_lens, layer.scale))
