"""Triton paged attention: the CUDA default backend.

Per step, the batch layout goes to the device in one pinned copy. Per layer: one kernel applies the
q/k norms and the rotary embedding and writes the new K/V (qk_norm_rope_cache; reshape_and_cache for
a layer without rotary), then requests with one query token go to the decode kernel (split-KV when the
batch is small) and the rest to the prefill kernel; a mixed batch is one forward pass with both.
Decode-only metadata can be copied into the static tensors of a captured CUDA graph. So can the metadata of
any step padded to a fixed (tokens, requests) shape (`padded_to`): both kernels then launch over grids fixed
by that shape, their padding programs returning at once, so one graph serves every mix of prefills and
decodes of up to that many tokens and requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.attention import mla_split
from tokenmill.attention.backend import AttentionBackend, BatchLayout, FixedShape
from tokenmill.device_copy import pack_to_device
from tokenmill.kernels.decode_attention import decode_attention
from tokenmill.kernels.decode_placement import place_decode_rows
from tokenmill.kernels.mla_cache import write_latent_cache
from tokenmill.kernels.mla_decode import mla_decode_attention, mla_prefill_attention
from tokenmill.kernels.prefill_attention import prefill_attention
from tokenmill.kernels.qk_norm_rope_cache import qk_norm_rope_cache
from tokenmill.kernels.reshape_and_cache import reshape_and_cache

FIXED_GRID_SPLITS = 2
"""Split-KV for the decodes of a fixed grid, whose count the graph does not know. H200, Llama-3.1-8B heads, 16
decodes of 1,500 tokens in 256 slots: 59 us unsplit, 36 us in 2 splits, 40 in 4 (30 us eagerly, 3 splits, no
empty slots)."""


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int32; -1 for padding tokens (nothing stored)
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    decode_req_ids: torch.Tensor  # [num_decodes] int32: requests with one query token
    prefill_req_ids: torch.Tensor  # [num_prefills] int32: the others
    num_prefills: torch.Tensor  # [1] int32: how many of prefill_req_ids count (read on a fixed grid)
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    max_prefill_len: int
    packed: torch.Tensor
    """The bytes of the six vectors above and their alignment padding, contiguous (one copy for graphs)."""
    fixed_grid: bool = False
    """Padded to a fixed shape: decode_req_ids and prefill_req_ids end in -1s, kernels launch on fixed grids."""
    layout: BatchLayout | None = None  # the host layout, for MLA's split (attention.mla_split)
    mla_splits: dict = field(default_factory=dict)
    tree_lens: torch.Tensor | None = None  # [num_reqs] int32: draft-tree nodes ending each request's keys
    tree_bits: torch.Tensor | None = None  # [num_tokens] int64: the nodes each query sees
    tree_packed: torch.Tensor | None = None
    """The bytes of the two above, contiguous (one copy for graphs)."""


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    supports_device_positions = True
    supports_mixed_cuda_graphs = True

    def build_metadata(self, layout: BatchLayout, device: torch.device,
                       padded_to: FixedShape | None = None) -> TritonAttentionMetadata:
        q_lens = np.diff(layout.query_start_loc)
        is_decode = layout.decode_requests()
        tree = None
        if layout.tree_lens is not None:  # a request with tree nodes needs the prefill kernel's mask
            tree_lens, tree_bits = layout.tree_lens.astype(np.int32), layout.tree_bits.astype(np.int64)
            if padded_to is not None:  # padding requests have no nodes; padding tokens see nothing anyway
                num_reqs = padded_to.num_decodes + padded_to.num_prefills
                tree_lens = np.concatenate([tree_lens, np.zeros(num_reqs - len(tree_lens), dtype=np.int32)])
                tree_bits = np.concatenate([tree_bits, np.full(padded_to.num_tokens - len(tree_bits), -1)])
            tree_packed, _, tree = pack_to_device([tree_lens, tree_bits], device)
        decode_ids, prefill_ids = np.flatnonzero(is_decode), np.flatnonzero(~is_decode)
        max_prefill_len = int(q_lens[prefill_ids].max()) if len(prefill_ids) else 0
        parts = [layout.slot_mapping, layout.query_start_loc, layout.seq_lens, decode_ids, prefill_ids,
                 np.array([len(prefill_ids)]), layout.block_table]
        if padded_to is not None:
            num_reqs = padded_to.num_decodes + padded_to.num_prefills
            # Padding tokens store nothing; padding requests are empty; -1 request slots launch programs that
            # return at once.
            fills = [-1, layout.query_start_loc[-1], 0, -1, -1]
            sizes = [padded_to.num_tokens, num_reqs + 1, num_reqs, padded_to.num_decodes, padded_to.num_prefills]
            for i, (fill, size) in enumerate(zip(fills, sizes)):
                parts[i] = np.concatenate([parts[i], np.full(size - len(parts[i]), fill, dtype=parts[i].dtype)])
            block_table = np.zeros((num_reqs, padded_to.num_block_columns), dtype=np.int32)
            block_table[: len(layout.seq_lens), : layout.block_table.shape[1]] = layout.block_table
            parts[-1] = block_table
        packed, starts, views = pack_to_device([part.astype(np.int32, copy=False) for part in parts], device)
        return TritonAttentionMetadata(
            *views,
            max_prefill_len=max_prefill_len,
            packed=packed[: starts[-1]],
            layout=layout,
            fixed_grid=padded_to is not None,
            tree_lens=None if tree is None else tree[0],
            tree_bits=None if tree is None else tree[1],
            tree_packed=None if tree is None else tree_packed,
        )

    def forward(
        self, layer, positions, query, key, value, kv_cache, metadata: TritonAttentionMetadata
    ) -> torch.Tensor:
        if layer.rotary_emb is not None:
            query = qk_norm_rope_cache(layer.rotary_emb.table_rows(positions), query, key, value, kv_cache,
                                       metadata.slot_mapping, layer.rotary_emb.cos_sin_cache, layer.q_norm,
                                       layer.k_norm, layer.k_scale, layer.v_scale)
        else:
            query, key = layer.transform_qk(positions, query, key)
            reshape_and_cache(key, value, kv_cache, metadata.slot_mapping, layer.k_scale, layer.v_scale)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        # The scales go by pointer (fp8 pools only read them): a captured graph reads their current values.
        args = dict(scale=layer.scale, sliding_window=layer.sliding_window, logits_soft_cap=layer.logits_soft_cap,
                    k_scale=layer.k_scale, v_scale=layer.v_scale)
        if metadata.fixed_grid:
            decode_attention(query, kv_cache, out, metadata.query_start_loc, metadata.seq_lens,
                             metadata.block_table, metadata.decode_req_ids, num_splits=FIXED_GRID_SPLITS, **args)
            prefill_attention(query, kv_cache, out, metadata.query_start_loc, metadata.seq_lens,
                              metadata.block_table, metadata.prefill_req_ids, 0, num_reqs=metadata.num_prefills,
                              tree_lens=metadata.tree_lens, tree_bits=metadata.tree_bits, **args)
            return out
        if metadata.decode_req_ids.numel():
            decode_attention(query, kv_cache, out, metadata.query_start_loc, metadata.seq_lens,
                             metadata.block_table, metadata.decode_req_ids, **args)
        if metadata.prefill_req_ids.numel():
            prefill_attention(query, kv_cache, out, metadata.query_start_loc, metadata.seq_lens,
                              metadata.block_table, metadata.prefill_req_ids, metadata.max_prefill_len,
                              tree_lens=metadata.tree_lens, tree_bits=metadata.tree_bits, **args)
        return out

    def forward_mla(self, layer, q_nope, q_pe, c_kv, k_pe, projections, kv_cache,
                    metadata: TritonAttentionMetadata) -> torch.Tensor:
        """kernels.mla_cache writes the latent rows; the absorbed requests go to kernels.mla_decode (decode and
        multi-token queries), the expanded ones to the prefill kernel (attention.mla_split)."""
        assert not metadata.fixed_grid, "MLA's split reads the step's layout on the host: no fixed-grid graphs"
        assert metadata.tree_lens is None, "latent attention has no draft-tree masks (refused at start-up)"
        write_latent_cache(c_kv, k_pe, kv_cache, metadata.slot_mapping, layer.k_scale)
        return mla_split.forward_mla(self, layer, q_nope, q_pe, projections, kv_cache, metadata)

    def latent_attention(self, layer, query, kv_cache, metadata: TritonAttentionMetadata) -> torch.Tensor:
        out = torch.empty((*query.shape[:2], layer.kv_lora_rank), dtype=query.dtype, device=query.device)
        if metadata.decode_req_ids.numel():
            mla_decode_attention(query, kv_cache, out, metadata.query_start_loc, metadata.seq_lens,
                                 metadata.block_table, metadata.decode_req_ids, layer.scale, layer.k_scale)
        if metadata.prefill_req_ids.numel():
            mla_prefill_attention(query, kv_cache, out, metadata.query_start_loc, metadata.seq_lens,
                                  metadata.block_table, metadata.prefill_req_ids, metadata.max_prefill_len,
                                  layer.scale, layer.k_scale)
        return out

    def expanded_attention(self, query, pool, expanded, scale) -> torch.Tensor:
        """The pool holds the decompressed keys and (zero-padded) values in the query's dtype: no fp8 scales. The
        kernel pads the head width to a power of two in registers and masks the loads past it."""
        out = torch.empty_like(query)
        prefill_attention(query, pool, out, expanded.query_start_loc, expanded.seq_lens, expanded.block_table,
                          expanded.req_ids, expanded.max_query_len, scale)
        return out

    def place_decodes(self, metadata: TritonAttentionMetadata, positions: torch.Tensor, block_size: int,
                      block_table: torch.Tensor | None = None, padded: bool = False) -> None:
        # One launch (kernels/decode_placement.py); a negative position (padding: `padded`) gets no context, no slot.
        place_decode_rows(positions, metadata.block_table, metadata.seq_lens, metadata.slot_mapping, block_size,
                          source_table=block_table)

    def copy_metadata(self, dst: TritonAttentionMetadata, src: TritonAttentionMetadata) -> None:
        """Copy a step's metadata into a captured graph's static metadata for the same batch shape."""
        assert dst.packed.shape == src.packed.shape and dst.fixed_grid == src.fixed_grid
        assert dst.fixed_grid or dst.max_prefill_len == src.max_prefill_len
        assert (dst.tree_packed is None) == (src.tree_packed is None), "a graph captured with draft-tree masks or not"
        dst.packed.copy_(src.packed, non_blocking=True)
        if dst.tree_packed is not None:
            dst.tree_packed.copy_(src.tree_packed, non_blocking=True)
        dst.block_table[:, : src.block_table.shape[1]].copy_(src.block_table, non_blocking=True)
