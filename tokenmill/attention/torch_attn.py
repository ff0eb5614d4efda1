"""PyTorch attention over the paged KV pool: the CPU backend and the reference for GPU kernels.

Each request's K/V is gathered from its blocks and attended with a causal mask offset by the
tokens already in the cache (so chunked prefill and decode are the same code).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.attention.backend import AttentionBackend, BatchLayout


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int64
    query_start_loc: list[int]  # [num_reqs + 1], host side: the per-request loop needs no sync
    seq_lens: list[int]  # [num_reqs]
    block_size: int


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks]
    query_start_loc: list[int],
    seq_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    num_heads = query.shape[1]
    groups = num_heads // num_kv_heads
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        num_queries = end - start
        blocks = block_table[i, : -(-seq_len // block_size)]
        # index_select: plain advanced indexing on the pool is orders of magnitude slower on CPU.
        k = key_cache.index_select(0, blocks).reshape(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1)
        v = value_cache.index_select(0, blocks).reshape(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1)
        k, v = k.to(query.dtype), v.to(query.dtype)
        q = query[start:end].transpose(0, 1)  # [num_heads, n, head_dim]
        unmasked = num_queries == 1 and (sliding_window is None or seq_len <= sliding_window)
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


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> TorchAttentionMetadata:
        return TorchAttentionMetadata(
            slot_mapping=torch.from_numpy(layout.slot_mapping).to(device),
            block_table=torch.from_numpy(layout.block_table).to(device, torch.int64),
            query_start_loc=layout.query_start_loc.tolist(),
            seq_lens=layout.seq_lens.tolist(),
            block_size=layout.block_size,
        )

    def forward(self, layer, query, key, value, kv_cache, metadata: TorchAttentionMetadata) -> torch.Tensor:
        write_kv(kv_cache, key, value, metadata.slot_mapping)
        return paged_attention_ref(
            query, kv_cache, metadata.block_table, metadata.query_start_loc, metadata.seq_lens,
            layer.scale, layer.sliding_window, layer.logits_soft_cap,
        )
