"""Attention over the paged KV pool for the CPU (the GPU kernels' float64 reference is
kernels.prefill_attention.paged_attention_ref).

On the CPU, float32 and bfloat16 go through a C kernel (attention.cpu_kernel) that reads each request's
context in place through its block table, whatever the number of new tokens per request, draft trees' masks
included. The torch path below is the fallback (no C compiler, float16, another device): single-token
(decode) requests are attended together in one batched matmul over their gathered, padded K/V; requests
with several new tokens (prefill chunks) one by one, with a causal mask offset by the tokens already in
the cache.
An fp8 or int8 pool (kv_cache_dtype fp8 / int8) always takes the torch path: K/V are quantized as they are
written and dequantized (kernels.kv_fp8, kernels.kv_int8: each row with its own scale, gathered beside it) as
each request's context is gathered.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.attention import mla_split
from tokenmill.attention.backend import AttentionBackend, BatchLayout
from tokenmill.attention.cpu_kernel import (
    kernel_applies,
    paged_attention_cpu,
    rope_and_cache_applies,
    rope_cache_attention,
)
from tokenmill.kernels.kv_fp8 import as_bytes, dequantize_kv, quantize_kv
from tokenmill.kernels.kv_int8 import dequantize_rows, is_int8, quantize_rows
from tokenmill.spec.tree import tree_mask


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int64
    query_start_loc: list[int]  # [num_reqs + 1], host side: the per-request loop needs no sync
    seq_lens: list[int]  # [num_reqs]
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int64, for the C kernel
    seq_lens_cpu: torch.Tensor  # [num_reqs] int64
    max_seq_len: int
    block_size: int
    decode_token_ids: torch.Tensor  # [num_decodes] flat index of each single-token request's query
    decode_seq_lens: torch.Tensor  # [num_decodes] int64
    decode_block_table: torch.Tensor  # [num_decodes, max_decode_blocks] int64
    layout: BatchLayout | None = None  # the host layout, for MLA's split (attention.mla_split)
    mla_splits: dict = field(default_factory=dict)
    tree_lens: list[int] | None = None  # [num_reqs] draft-tree nodes ending each request's keys (None: no tree)
    tree_bits: torch.Tensor | None = None  # [num_tokens] int64: the nodes each query sees
    tree_lens_cpu: torch.Tensor | None = None  # [num_reqs] int64, for the C kernel


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    for pool, x, scale in ((kv_cache[0], key, k_scale), (kv_cache[1], value, v_scale)):
        if is_int8(kv_cache.dtype):  # each row's scale goes to its slot beside it
            stored, row_scales = quantize_rows(x)
            scale.view(-1, num_kv_heads).index_copy_(0, slot_mapping, row_scales)
        else:
            stored = quantize_kv(x, scale, kv_cache.dtype)
        as_bytes(pool).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, as_bytes(stored))


def gather_kv(pool: torch.Tensor, scale: torch.Tensor | None, blocks: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor:
    """The blocks' K or V [len(blocks), block_size, num_kv_heads, head_dim] read back in `dtype`: an int8 pool's
    rows times their own scales, an fp8 pool's times the layer's (index_select: plain advanced indexing on the
    pool is orders of magnitude slower on CPU)."""
    rows = pool.index_select(0, blocks)
    if is_int8(pool.dtype):
        return dequantize_rows(rows, scale.index_select(0, blocks), dtype)
    return dequantize_kv(rows, scale, dtype)


def paged_attention_torch(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks]
    query_start_loc: list[int],
    seq_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    skip_decodes: bool = False,
    k_scale: torch.Tensor | None = None,  # an fp8 pool's scales ([] float32) or an int8 pool's (kernels.kv_int8)
    v_scale: torch.Tensor | None = None,
    tree_lens: list[int] | None = None,  # draft-tree masks, as kernels.prefill_attention takes them
    tree_bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for every request, one at a time; `skip_decodes` leaves single-token requests'
    rows unwritten for the batched decode path to fill (a request with tree nodes is never skipped)."""
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    num_heads = query.shape[1]
    groups = num_heads // num_kv_heads
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        num_queries = end - start
        tree_len = 0 if tree_lens is None else tree_lens[i]
        if skip_decodes and num_queries == 1 and not tree_len:
            continue
        blocks = block_table[i, : -(-seq_len // block_size)]
        k = gather_kv(key_cache, k_scale, blocks, query.dtype).reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = gather_kv(value_cache, v_scale, blocks, query.dtype).reshape(-1, num_kv_heads, head_dim)[:seq_len]
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        q = query[start:end].transpose(0, 1)  # [num_heads, n, head_dim]
        unmasked = num_queries == 1 and not tree_len and (sliding_window is None or seq_len <= sliding_window)
        if unmasked and logits_soft_cap is None:
            # One query sees every cached key: no mask, which keeps SDPA on its fast GQA path.
            o = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), scale=scale,
                                               enable_gqa=groups > 1)[0]
            out[start:end] = o.transpose(0, 1)
            continue
        q_pos = torch.arange(seq_len - num_queries, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        if tree_len:
            mask &= tree_mask(tree_bits[start:end], seq_len, tree_len)
        # SDPA with both a mask and enable_gqa falls back to a very slow path: expand heads instead.
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
        if logits_soft_cap is None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        else:
            scores = torch.matmul(q, k.transpose(1, 2)) * scale
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
            scores = scores.masked_fill(~mask, float("-inf"))
            o = torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)
        out[start:end] = o.transpose(0, 1)
    return out


def batched_decode_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], decode rows written in place
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    token_ids: torch.Tensor,  # [num_decodes]
    seq_lens: torch.Tensor,  # [num_decodes]
    block_table: torch.Tensor,  # [num_decodes, max_blocks]
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    num_decodes, max_blocks = block_table.shape
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    groups = query.shape[1] // num_kv_heads
    length = max_blocks * block_size
    flat_blocks = block_table.reshape(-1)
    q = query.index_select(0, token_ids).view(num_decodes, num_kv_heads, groups, head_dim)
    # [num_decodes, num_kv_heads, length, head_dim]
    k = gather_kv(kv_cache[0], k_scale, flat_blocks, q.dtype).view(num_decodes, length, num_kv_heads, head_dim)
    v = gather_kv(kv_cache[1], v_scale, flat_blocks, q.dtype).view(num_decodes, length, num_kv_heads, head_dim)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    scores = torch.matmul(q, k.transpose(2, 3)).float() * scale  # [n, kv_heads, groups, length]
    if logits_soft_cap is not None:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    positions = torch.arange(length, device=query.device)
    visible = positions[None, :] < seq_lens[:, None]
    if sliding_window is not None:
        visible &= positions[None, :] >= (seq_lens - sliding_window)[:, None]
    scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
    # Slots past a request's length were never written (the pool is torch.empty): they may hold NaN,
    # and a zero attention weight times NaN is still NaN.
    v = v.masked_fill(~visible[:, None, :, None], 0.0)
    o = torch.matmul(scores.softmax(dim=-1).to(q.dtype), v)  # [n, kv_heads, groups, head_dim]
    out.index_copy_(0, token_ids, o.reshape(num_decodes, -1, head_dim))


def latent_as_kv(kv_cache: torch.Tensor) -> torch.Tensor:
    """MLA's latent cache [num_blocks, block_size, width] as a K/V pool [2, num_blocks, block_size, 1, width]
    whose K and V are both the latent row (a view, nothing copied): the generic paths attend over it, and the
    output's first kv_lora_rank dims are the latent attention's (the rest is k_pe's, dropped)."""
    return kv_cache.unsqueeze(2).unsqueeze(0).expand(2, -1, -1, -1, -1)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    # Its per-request loops read the lengths on the host: placing them reads the positions there (free on the CPU).
    supports_device_positions = True

    def place_decodes(self, metadata: TorchAttentionMetadata, positions: torch.Tensor, block_size: int) -> None:
        num = len(positions)
        blocks = metadata.block_table[:num].gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
        metadata.slot_mapping[:num] = blocks * block_size + positions % block_size
        seq_lens = (positions + 1).cpu()
        metadata.seq_lens_cpu[:num] = seq_lens
        metadata.seq_lens[:num] = seq_lens.tolist()
        metadata.decode_seq_lens[:num] = seq_lens.to(metadata.decode_seq_lens.device)  # its first num: all decodes
        if metadata.layout is not None:  # MLA's split reads the host layout
            layout = metadata.layout
            seq_lens_host, slots = layout.seq_lens.copy(), layout.slot_mapping.copy()
            seq_lens_host[:num], slots[:num] = seq_lens.numpy(), metadata.slot_mapping[:num].cpu().numpy()
            metadata.layout = replace(layout, seq_lens=seq_lens_host, slot_mapping=slots)
            metadata.mla_splits.clear()

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> TorchAttentionMetadata:
        qsl = layout.query_start_loc
        is_decode = layout.decode_requests()
        decode_seq_lens = layout.seq_lens[is_decode]
        max_decode_blocks = -(-int(decode_seq_lens.max()) // layout.block_size) if len(decode_seq_lens) else 0
        decode_block_table = layout.block_table[is_decode, :max_decode_blocks]
        to_device = lambda array: torch.from_numpy(array).to(device, torch.int64)
        return TorchAttentionMetadata(
            slot_mapping=to_device(layout.slot_mapping),
            block_table=to_device(layout.block_table),
            query_start_loc=qsl.tolist(),
            seq_lens=layout.seq_lens.tolist(),
            query_start_loc_cpu=torch.from_numpy(qsl.astype(np.int64)),
            seq_lens_cpu=torch.from_numpy(layout.seq_lens.astype(np.int64)),
            max_seq_len=int(layout.seq_lens.max()) if len(layout.seq_lens) else 0,
            block_size=layout.block_size,
            decode_token_ids=to_device(qsl[:-1][is_decode]),
            decode_seq_lens=to_device(decode_seq_lens),
            decode_block_table=to_device(decode_block_table),
            layout=layout,
            tree_lens=None if layout.tree_lens is None else layout.tree_lens.tolist(),
            tree_bits=None if layout.tree_bits is None else to_device(layout.tree_bits),
            tree_lens_cpu=None if layout.tree_lens is None else torch.from_numpy(layout.tree_lens.astype(np.int64)),
        )

    def forward(
        self, layer, positions, query, key, value, kv_cache, metadata: TorchAttentionMetadata
    ) -> torch.Tensor:
        if kernel_applies(query, kv_cache):
            if rope_and_cache_applies(layer, positions, key, value, metadata.max_seq_len):
                return rope_cache_attention(layer, positions, query, key, value, kv_cache, metadata.slot_mapping,
                                            metadata.block_table, metadata.query_start_loc_cpu, metadata.seq_lens_cpu,
                                            metadata.tree_lens_cpu, metadata.tree_bits)
            query, key = layer.transform_qk(positions, query, key)
            write_kv(kv_cache, key, value, metadata.slot_mapping)
            return paged_attention_cpu(
                query, kv_cache, metadata.block_table, metadata.query_start_loc_cpu, metadata.seq_lens_cpu,
                layer.scale, layer.sliding_window, layer.logits_soft_cap, metadata.tree_lens_cpu, metadata.tree_bits,
            )
        query, key = layer.transform_qk(positions, query, key)
        scales = dict(k_scale=layer.k_scale, v_scale=layer.v_scale)
        write_kv(kv_cache, key, value, metadata.slot_mapping, **scales)
        num_decodes = len(metadata.decode_token_ids)
        out = paged_attention_torch(
            query, kv_cache, metadata.block_table, metadata.query_start_loc, metadata.seq_lens,
            layer.scale, layer.sliding_window, layer.logits_soft_cap, skip_decodes=num_decodes > 0, **scales,
            tree_lens=metadata.tree_lens, tree_bits=metadata.tree_bits,
        )
        if num_decodes:
            batched_decode_attention(
                out, query, kv_cache, metadata.decode_token_ids, metadata.decode_seq_lens,
                metadata.decode_block_table, layer.scale, layer.sliding_window, layer.logits_soft_cap, **scales,
            )
        return out

    def forward_mla(self, layer, q_nope, q_pe, c_kv, k_pe, projections, kv_cache,
                    metadata: TorchAttentionMetadata) -> torch.Tensor:
        latent = torch.cat([c_kv, k_pe], dim=-1)  # [num_tokens, kv_lora_rank + rope_dim]
        stored = quantize_kv(latent, layer.k_scale, kv_cache.dtype)
        as_bytes(kv_cache).view(-1, latent.shape[1]).index_copy_(0, metadata.slot_mapping, as_bytes(stored))
        return mla_split.forward_mla(self, layer, q_nope, q_pe, projections, kv_cache, metadata)

    def latent_attention(self, layer, query, kv_cache, metadata: TorchAttentionMetadata) -> torch.Tensor:
        pool = latent_as_kv(kv_cache)
        if kernel_applies(query, pool):
            out = paged_attention_cpu(query, pool, metadata.block_table, metadata.query_start_loc_cpu,
                                      metadata.seq_lens_cpu, layer.scale)
            return out[..., : layer.kv_lora_rank]
        scales = dict(k_scale=layer.k_scale, v_scale=layer.k_scale)  # V is the stored K
        num_decodes = len(metadata.decode_token_ids)
        out = paged_attention_torch(query, pool, metadata.block_table, metadata.query_start_loc, metadata.seq_lens,
                                    layer.scale, skip_decodes=num_decodes > 0, **scales)
        if num_decodes:
            batched_decode_attention(out, query, pool, metadata.decode_token_ids, metadata.decode_seq_lens,
                                     metadata.decode_block_table, layer.scale, None, None, **scales)
        return out[..., : layer.kv_lora_rank]

    def expanded_attention(self, query, pool, expanded, scale) -> torch.Tensor:
        block_table = expanded.block_table.long()
        if kernel_applies(query, pool):
            return paged_attention_cpu(query, pool, block_table, torch.tensor(expanded.query_start_loc_host),
                                       torch.tensor(expanded.seq_lens_host), scale)
        return paged_attention_torch(query, pool, block_table, expanded.query_start_loc_host,
                                     expanded.seq_lens_host, scale)
