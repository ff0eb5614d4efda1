"""TritonAttentionBackend == TorchAttentionBackend on a mixed step, and graph-padded decode == unpadded."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from tokenmill.attention.backend import BatchLayout, FixedShape
from tokenmill.attention.torch_attn import TorchAttentionBackend
from tokenmill.layers.attention import Attention
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.worker.cuda_graph import pad_layout

pytestmark = pytest.mark.gpu
interpret = pytest.mark.interpret

# What the layer does to q and k before attention: nothing, Llama's rotary, or Qwen3's q/k norms with a
# rotary over part of each head (the fused kernel's every branch).
QK_TRANSFORMS = ["none", "rope", "qk_norm+partial_rope"]


def _layer(heads, kv_heads, head_dim, device, qk_transform="none", **options) -> Attention:
    g = torch.Generator().manual_seed(2)
    modules = {}
    if qk_transform != "none":
        rotary_dim = head_dim // 2 if "partial" in qk_transform else head_dim
        modules["rotary_emb"] = RotaryEmbedding(LlamaConfig(rope_theta=10000.0), head_dim, 512, rotary_dim).to(device)
    if "qk_norm" in qk_transform:
        for name in ("q_norm", "k_norm"):
            modules[name] = RMSNorm(head_dim, 1e-6).to(device)
            modules[name].weight.copy_(1 + 0.1 * torch.randn(head_dim, generator=g))
    return Attention(heads, head_dim, head_dim**-0.5, kv_heads, **options, **modules)


def _positions(layout: BatchLayout, device) -> torch.Tensor:
    q_lens = np.diff(layout.query_start_loc)
    starts = layout.seq_lens - q_lens
    return torch.from_numpy(np.concatenate([np.arange(s, s + n) for s, n in zip(starts, q_lens)])).to(device)


def _make_step(q_lens, context_lens, block_size, num_blocks, rng):
    seq_lens = np.array(context_lens) + np.array(q_lens)
    max_blocks = int(-(-seq_lens.max() // block_size))
    block_table = rng.permutation(num_blocks)[: len(q_lens) * max_blocks].reshape(len(q_lens), max_blocks)
    positions = np.concatenate([np.arange(c, c + q) for c, q in zip(context_lens, q_lens)])
    rows = np.repeat(np.arange(len(q_lens)), q_lens)
    slots = block_table[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return BatchLayout(
        query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        block_table=block_table.astype(np.int32),
        slot_mapping=slots,
        block_size=block_size,
    )


@pytest.mark.parametrize("options", [{}, pytest.param({"sliding_window": 20, "logits_soft_cap": 3.0}, marks=interpret)],
                         ids=str)
@pytest.mark.parametrize("qk_transform", QK_TRANSFORMS)
def test_mixed_step_matches_torch_backend(device, options, qk_transform):
    from tokenmill.attention.triton_attn import TritonAttentionBackend

    rng = np.random.default_rng(0)
    block_size, num_blocks, heads, kv_heads, head_dim = 16, 64, 8, 2, 64
    layout = _make_step([1, 30, 1, 5], [40, 0, 100, 20], block_size, num_blocks, rng)
    num_tokens = int(layout.query_start_loc[-1])
    g = torch.Generator().manual_seed(0)
    q = torch.randn((num_tokens, heads, head_dim), generator=g).to(device)
    k = torch.randn((num_tokens, kv_heads, head_dim), generator=g).to(device)
    v = torch.randn((num_tokens, kv_heads, head_dim), generator=g).to(device)
    pool = torch.randn((2, num_blocks, block_size, kv_heads, head_dim), generator=g).to(device)
    layer = _layer(heads, kv_heads, head_dim, device, qk_transform, **options)
    positions, dev = _positions(layout, device), torch.device(device)

    torch_backend, triton_backend = TorchAttentionBackend(), TritonAttentionBackend()
    pool_ref = pool.clone()
    ref = torch_backend.forward(layer, positions, q, k, v, pool_ref, torch_backend.build_metadata(layout, dev))
    out = triton_backend.forward(layer, positions, q, k, v, pool, triton_backend.build_metadata(layout, dev))
    if qk_transform in ("none", "rope"):  # the rotary kernels round as torch does
        torch.testing.assert_close(pool, pool_ref, rtol=0, atol=0)
    else:  # a float32 sum of squares in another order may round its last bit otherwise
        torch.testing.assert_close(pool, pool_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@interpret
@pytest.mark.parametrize("qk_transform", QK_TRANSFORMS)
def test_padded_decode_matches_unpadded(device, qk_transform):
    from tokenmill.attention.triton_attn import TritonAttentionBackend

    rng = np.random.default_rng(1)
    block_size, num_blocks, heads, kv_heads, head_dim = 16, 64, 4, 4, 32
    layout = _make_step([1, 1, 1], [40, 3, 100], block_size, num_blocks, rng)
    g = torch.Generator().manual_seed(1)
    q = torch.randn((3, heads, head_dim), generator=g).to(device)
    k = torch.randn((3, kv_heads, head_dim), generator=g).to(device)
    v = torch.randn((3, kv_heads, head_dim), generator=g).to(device)
    pool = torch.randn((2, num_blocks, block_size, kv_heads, head_dim), generator=g).to(device)
    layer = _layer(heads, kv_heads, head_dim, device, qk_transform)
    backend, dev, positions = TritonAttentionBackend(), torch.device(device), _positions(layout, device)

    pool_expected = pool.clone()
    expected = backend.forward(layer, positions, q, k, v, pool_expected, backend.build_metadata(layout, dev))
    # Static metadata as a graph captures it (wide block table), then a step's copied into it.
    static = backend.build_metadata(pad_layout(layout, 8, num_block_columns=20), dev)
    backend.copy_metadata(static, backend.build_metadata(pad_layout(layout, 8), dev))
    q_pad = torch.cat([q, torch.randn((5, heads, head_dim), generator=g).to(device)])
    k_pad = torch.cat([k, torch.randn((5, kv_heads, head_dim), generator=g).to(device)])
    v_pad = torch.cat([v, torch.randn((5, kv_heads, head_dim), generator=g).to(device)])
    positions_pad = torch.cat([positions, torch.zeros(5, dtype=positions.dtype, device=device)])  # as graphs pad
    pool_padded = pool.clone()
    out = backend.forward(layer, positions_pad, q_pad, k_pad, v_pad, pool_padded, static)
    torch.testing.assert_close(out[:3], expected, rtol=1e-5, atol=1e-5)
    assert torch.all(out[3:] == 0)  # padding requests attend to nothing...
    torch.testing.assert_close(pool_padded, pool_expected, rtol=0, atol=0)  # ...and store nothing


@interpret
@pytest.mark.parametrize("q_lens, context_lens", [
    ([1, 30, 1, 5, 70], [40, 0, 100, 20, 3]),  # prompt chunks beside decodes
    ([3] * 12 + [1, 1], [3 * i for i in range(14)]),  # verification: more tiles than programs, which take turns
], ids=["prompts", "verification"])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 20, "logits_soft_cap": 3.0}], ids=["plain", "window"])
def test_fixed_grid_step_matches_unpadded(device, q_lens, context_lens, options):
    """A mixed step padded to a full-step graph's shape (fixed grids, -1 padded request lists, padding tokens)
    attends and stores as the same step unpadded."""
    from tokenmill.attention.triton_attn import TritonAttentionBackend

    rng = np.random.default_rng(3)
    block_size, num_blocks, heads, kv_heads, head_dim = 16, 64, 4, 2, 32
    layout = _make_step(q_lens, context_lens, block_size, num_blocks, rng)
    n, size = int(layout.query_start_loc[-1]), 128
    g = torch.Generator().manual_seed(3)
    q = torch.randn((size, heads, head_dim), generator=g).to(device)
    k = torch.randn((size, kv_heads, head_dim), generator=g).to(device)
    v = torch.randn((size, kv_heads, head_dim), generator=g).to(device)
    pool = torch.randn((2, num_blocks, block_size, kv_heads, head_dim), generator=g).to(device)
    layer = _layer(heads, kv_heads, head_dim, device, "rope", **options)
    backend, dev, positions = TritonAttentionBackend(), torch.device(device), _positions(layout, device)

    pool_expected = pool.clone()
    expected = backend.forward(layer, positions, q[:n], k[:n], v[:n], pool_expected,
                               backend.build_metadata(layout, dev))
    # As a graph captures it: an empty step at the full shape, the step's metadata copied in at its own width.
    empty = BatchLayout(np.zeros(1, np.int32), np.zeros(0, np.int32), np.zeros((0, 20), np.int32),
                        np.zeros(0, np.int64), block_size)
    static = backend.build_metadata(empty, dev, padded_to=FixedShape(size, 16, 16, 20))
    step = backend.build_metadata(layout, dev, padded_to=FixedShape(size, 16, 16, layout.block_table.shape[1]))
    backend.copy_metadata(static, step)
    positions_pad = torch.cat([positions, torch.zeros(size - n, dtype=positions.dtype, device=device)])
    out = backend.forward(layer, positions_pad, q, k, v, pool, static)
    # Not bitwise: on a GPU the unpadded step splits its decodes' contexts (split-KV), the fixed grid does not.
    torch.testing.assert_close(out[:n], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, pool_expected, rtol=0, atol=0)  # the padding tokens store nothing


@interpret
def test_tree_step_matches_torch_backend(device):
    """A step verifying a draft tree (root and 6 nodes), an EAGLE head's level pass of one node (a single query
    with tree nodes: the prefill kernel, not the decode kernel) and a decode: both backends alike."""
    from tokenmill.attention.triton_attn import TritonAttentionBackend
    from tokenmill.config import parse_token_tree
    from tokenmill.spec.tree import TokenTree

    tree = TokenTree.from_paths(parse_token_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]))
    rng = np.random.default_rng(1)
    block_size, num_blocks, heads, kv_heads, head_dim = 16, 64, 4, 2, 32
    layout = _make_step([1 + tree.num_nodes, 1, 1], [40, 30, 25], block_size, num_blocks, rng)
    layout.tree_lens = np.array([tree.num_nodes, 3, 0], dtype=np.int32)
    layout.tree_bits = np.concatenate([[-1], tree.ancestor_bits, [tree.ancestor_bits[2], -1]]).astype(np.int64)
    # A node's position is the root's plus its depth (its slot is its buffer index, as _make_step laid out).
    positions = np.concatenate([[40], 40 + tree.depth, [30 + int(tree.depth[2]) - 1 - 2], [25]])
    num_tokens = int(layout.query_start_loc[-1])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn((num_tokens, n, head_dim), generator=g).to(device) for n in (heads, kv_heads, kv_heads))
    pool = torch.randn((2, num_blocks, block_size, kv_heads, head_dim), generator=g).to(device)
    layer = _layer(heads, kv_heads, head_dim, device, "rope")
    positions, dev = torch.from_numpy(positions).to(device), torch.device(device)
    torch_backend, triton_backend = TorchAttentionBackend(), TritonAttentionBackend()
    pool_ref = pool.clone()
    ref = torch_backend.forward(layer, positions, q, k, v, pool_ref, torch_backend.build_metadata(layout, dev))
    metadata = triton_backend.build_metadata(layout, dev)
    assert metadata.decode_req_ids.tolist() == [2]
    out = triton_backend.forward(layer, positions, q, k, v, pool, metadata)
    torch.testing.assert_close(pool, pool_ref, rtol=0, atol=0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@interpret
def test_graphs_with_tree_masks_replay_tree_steps_and_plain_steps(device):
    """Full-step graphs captured with draft-tree masks (worker.mixed_cuda_graph, trees=True), emulated as
    test_fixed_grid_step_matches_unpadded does: a tree verification beside a decode and a prompt chunk, and a step
    without trees, each copied into the static metadata of an empty step, attend and store as they do eagerly."""
    from tokenmill.attention.triton_attn import TritonAttentionBackend
    from tokenmill.config import parse_token_tree
    from tokenmill.spec.tree import TokenTree
    from tokenmill.worker.mixed_cuda_graph import MixedCudaGraphRunner

    tree = TokenTree.from_paths(parse_token_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]))
    block_size, num_blocks, heads, kv_heads, head_dim = 16, 64, 4, 2, 32
    backend, dev = TritonAttentionBackend(), torch.device(device)
    runner = MixedCudaGraphRunner(None, backend, dev, block_size, max_blocks_per_req=20, max_num_reqs=8,
                                  max_tokens=32, trees=True)
    layer = _layer(heads, kv_heads, head_dim, device, "rope")
    tree_step = _make_step([1 + tree.num_nodes, 1, 5], [40, 30, 20], block_size, num_blocks, np.random.default_rng(4))
    tree_step.tree_lens = np.array([tree.num_nodes, 0, 0], dtype=np.int32)
    tree_step.tree_bits = np.concatenate([[-1], tree.ancestor_bits, [-1] * 6]).astype(np.int64)
    tree_positions = torch.from_numpy(np.concatenate([[40], 40 + tree.depth, [30], np.arange(20, 25)])).to(device)
    plain_step = _make_step([1, 9, 1], [12, 7, 50], block_size, num_blocks, np.random.default_rng(5))
    for layout, positions in ((tree_step, tree_positions), (plain_step, _positions(plain_step, device))):
        n = int(layout.query_start_loc[-1])
        size = runner._graph_size(layout)
        assert size == 16
        g = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn((size, h, head_dim), generator=g).to(device) for h in (heads, kv_heads, kv_heads))
        pool = torch.randn((2, num_blocks, block_size, kv_heads, head_dim), generator=g).to(device)
        pool_expected = pool.clone()
        expected = backend.forward(layer, positions, q[:n], k[:n], v[:n], pool_expected,
                                   backend.build_metadata(layout, dev))
        empty = BatchLayout(np.zeros(1, np.int32), np.zeros(0, np.int32), np.zeros((0, 20), np.int32),
                            np.zeros(0, np.int64), block_size)
        static = runner._metadata(empty, size)
        backend.copy_metadata(static, runner._metadata(layout, size))
        positions_pad = torch.cat([positions, torch.zeros(size - n, dtype=positions.dtype, device=device)])
        out = backend.forward(layer, positions_pad, q, k, v, pool, static)
        torch.testing.assert_close(out[:n], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool, pool_expected, rtol=0, atol=0)


@interpret
@torch.no_grad()
def test_tree_level_graphs_replay_level_passes(device):
    """The graphs of an EAGLE draft tree's level passes (worker.tree_cuda_graph), emulated as above: each level's
    pass of 3 rows, loaded into the graph of 4 rows (static metadata and inputs as captured, padding rows and
    tokens stale) and run as the graph runs it, gives the eager pass's tokens and outputs and stores the same KV
    at the nodes' slots, nothing elsewhere."""
    from tokenmill.attention.triton_attn import TritonAttentionBackend
    from tokenmill.config import parse_token_tree
    from tokenmill.forward_context import forward_context
    from tokenmill.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from tokenmill.spec.eagle import EagleHead
    from tokenmill.spec.tree import TokenTree
    from tokenmill.spec.tree_level import TreeLevelStep, level_layout
    from tokenmill.worker.tree_cuda_graph import TreeLevelGraphRunner

    tree = TokenTree.from_paths(parse_token_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]))
    block_size, num_blocks, hidden, dev = 16, 32, 64, torch.device(device)
    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    with torch.device(dev):
        embed, lm_head = VocabParallelEmbedding(256, hidden), ParallelLMHead(256, hidden)
        head = EagleHead(config, set(), embed, lm_head.compute_logits)
    for module in (head, embed, lm_head):
        for name, param in module.named_parameters():
            param.copy_(1 + 0.1 * torch.randn_like(param) if "norm" in name else 0.3 * torch.randn_like(param))
    attn = next(m for m in head.modules() if isinstance(m, Attention))
    attn.allocate_kv_cache(num_blocks, block_size, torch.float32, dev)
    attn.kv_cache.normal_()  # the rows' context
    steps = [TreeLevelStep(head, lambda h, k: lm_head.compute_logits(h).topk(k, dim=-1).indices, tree, depth, dev)
             for depth in (1, 2)]
    runner = TreeLevelGraphRunner(steps, TritonAttentionBackend(), dev, block_size, max_blocks_per_req=8,
                                  max_num_reqs=8, max_tokens=12, hidden_size=hidden, dtype=torch.float32)
    assert runner.sizes == {1: [1, 2, 4, 6], 2: [1, 2, 4]}  # passes of at most 12 tokens: widths 2 and 3
    assert runner._graph_rows(1, 5) == 6 and runner._graph_rows(2, 5) is None  # a larger pass runs eagerly
    block_table = np.random.default_rng(0).permutation(num_blocks)[:24].reshape(3, 8).astype(np.int32)
    rows, lengths = np.arange(3), np.array([20, 33, 9])
    parent_out = torch.randn(3, 1, hidden, device=dev)  # the root's: each row's head output at its last position
    tokens = None
    for depth, step in zip((1, 2), steps):
        layout, positions = level_layout(tree, depth, block_table, rows, lengths, block_size)
        positions = torch.from_numpy(positions).to(dev)
        pool = attn.kv_cache.clone()
        with forward_context(runner.attn_backend, runner.attn_backend.build_metadata(layout, dev)):
            expected = step(positions, parent_out, tokens)
        pool_expected, attn.kv_cache[:] = attn.kv_cache.clone(), pool
        assert runner._graph_rows(depth, 3) == 4
        static = runner._eager_forward(depth, 4)  # what capture() records the graph with: no requests
        runner.inputs[depth][0].fill_(7)  # stale padding: a replay after other passes
        runner._load(depth, 4, static, layout, positions, parent_out, tokens)
        with forward_context(runner.attn_backend, static):
            got = step(*runner._static_inputs(depth, 4))
        for g, e in zip(got, expected):  # the tokens alike, the rest to rounding (GEMMs of more rows)
            torch.testing.assert_close(g[:3], e, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(attn.kv_cache, pool_expected, rtol=1e-4, atol=1e-4)
        untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
        untouched[torch.from_numpy(layout.slot_mapping)] = False
        assert torch.equal(attn.kv_cache.flatten(1, 2)[:, untouched], pool.flatten(1, 2)[:, untouched])  # padding
        _, parent_out, tokens = expected
