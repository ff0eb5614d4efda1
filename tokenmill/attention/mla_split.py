"""MLA's two forms in one step (layers.mla): each request runs either absorbed or expanded.

- absorbed: queries through W_UK into the latent space, attention over the cached latent rows [c_kv | k_pe] (one
  576-wide "head" for DeepSeek), the output back through W_UV (the backends' latent_attention).
- expanded: the request's cached latent rows, its context and this step's tokens alike, decompressed by kv_b_proj
  into per-head keys [k_nope | k_pe] and values, then ordinary causal multi-head attention (expanded_attention);
  the latent cache stays the only store, written as for the absorbed form.

Per head, a request of Q new tokens over T keys (kv_lora_rank L, qk_nope N, qk_rope R, v_head_dim V) costs about
    absorbed: Q·L·(N + V) (query in, output out)   + Q·T·(2L + R) (scores over L + R, values over L)
    expanded: T·L·(N + V) (every key decompressed) + Q·T·(N + R + V)
multiply-adds. A prompt (T = Q) is always cheaper expanded, 3.4x less attention at DeepSeek's sizes; a decode or a
1 + k verification over a long context stays absorbed, as does a short chunk after a long prefix (at DeepSeek's
sizes a chunk over a long context expands from about 170 tokens on). prefers_expanded picks the cheaper per request.

The split is built on the host from the step's BatchLayout the first time an MLA layer runs, and kept on the step's
metadata: a decode-only step (the CUDA-graph path) is all absorbed and builds nothing; a mixed step gets the
absorbed requests' own metadata (the backend's build_metadata over their sub-layout) and the expanded requests'
query rows, latent blocks and a block table over those blocks, in one device copy.

Memory: the decompressed keys and values take H·(2·head_dim) per key against the absorbed form's H·(2L + R) per
query token, so a chunk over a context longer than itself is decompressed and attended a few heads at a time
(ExpandedRequests.heads_per_pass): no more keys x heads at once than a prompt-only step of as many tokens, which
is what the memory profile measured. Splitting the context instead (partial attentions merged by their
log-sum-exp) would keep every head in one launch, but needs the prefill kernel to return the log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from tokenmill.attention.backend import BatchLayout
from tokenmill.device_copy import pack_to_device
from tokenmill.kernels.kv_fp8 import dequantize_kv


class LatentProjections(Protocol):
    """What the model's MLA module (layers.mla.MultiHeadLatentAttention) gives the backends."""

    qk_nope_head_dim: int
    v_head_dim: int

    def absorb_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """[n, H, N], [n, H, R] -> [n, H, L + R]: [W_UK^T q_nope | q_pe]."""

    def latent_to_values(self, latent_out: torch.Tensor) -> torch.Tensor:
        """[n, H, L] -> [n, H, V]: through W_UV."""

    def expand_latent(self, c_kv: torch.Tensor, heads: slice) -> torch.Tensor:
        """[n, L] -> [n, len(heads), N + V]: kv_b_proj, those heads' [k_nope | v]."""


def prefers_expanded(q_lens: np.ndarray, context_lens: np.ndarray, dims: tuple[int, int, int, int]) -> np.ndarray:
    """[num_reqs] bool: the requests cheaper in the expanded form (the module docstring's costs).
    dims: (kv_lora_rank, qk_nope, qk_rope, v_head_dim)."""
    latent, nope, rope, value = dims
    q, keys = q_lens.astype(np.int64), (context_lens + q_lens).astype(np.int64)
    absorbed = q * latent * (nope + value) + q * keys * (2 * latent + rope)
    expanded = keys * latent * (nope + value) + q * keys * (nope + rope + value)
    return (q > 1) & (expanded < absorbed)


@dataclass
class ExpandedRequests:
    """The requests of a step that run expanded, compacted: request i's queries are rows[query_start_loc[i]:
    query_start_loc[i + 1]] of the step, its keys the first seq_lens[i] rows of the latent blocks
    blocks[block_table[i]]."""

    rows: torch.Tensor  # [num_queries] int64: flat indices of their query tokens in the step
    blocks: torch.Tensor  # [num_blocks] int64: their latent-cache blocks, request after request
    query_start_loc: torch.Tensor  # [num_expanded + 1] int32, over `rows`
    seq_lens: torch.Tensor  # [num_expanded] int32
    block_table: torch.Tensor  # [num_expanded, max_blocks] int32: indices into `blocks`
    req_ids: torch.Tensor  # [num_expanded] int32: 0 .. num_expanded - 1
    max_query_len: int
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    pool_rows: int
    """len(blocks) * block_size: the keys decompressed, blocks' unused tails included."""
    row_budget: int
    """The most pool rows per head to hold at once: the step's tokens, each request's rounded up to whole blocks
    (a prompt-only step decompresses its rows in one pass, the step the memory profile runs)."""

    def heads_per_pass(self, num_heads: int) -> int:
        """A context longer than the step's own tokens is decompressed a few heads at a time, so that the pool
        never holds more keys x heads than a prompt-only step of this size does."""
        return max(1, min(num_heads, num_heads * self.row_budget // self.pool_rows))


@dataclass
class MlaSplit:
    expanded: ExpandedRequests | None = None
    """None: every request runs absorbed, over the step's own metadata."""
    absorbed_rows: torch.Tensor | None = None
    """[num_absorbed_tokens] int64: flat indices of the absorbed requests' tokens (when some are expanded)."""
    absorbed_metadata: object | None = None
    """The backend's metadata for the absorbed requests alone (None when there are none)."""


ALL_ABSORBED = MlaSplit()


def sub_layout(layout: BatchLayout, reqs: np.ndarray, token_rows: np.ndarray) -> BatchLayout:
    """The layout of requests `reqs` alone (token_rows: their tokens' flat indices, in order)."""
    q_lens = np.diff(layout.query_start_loc)[reqs]
    return BatchLayout(
        query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
        seq_lens=layout.seq_lens[reqs],
        block_table=layout.block_table[reqs],
        slot_mapping=layout.slot_mapping[token_rows],
        block_size=layout.block_size,
    )


def build_split(layout: BatchLayout, dims: tuple[int, int, int, int], device: torch.device,
                build_metadata) -> MlaSplit:
    """build_metadata(sub_layout, device): the backend's metadata for the absorbed requests."""
    qsl = layout.query_start_loc
    q_lens = np.diff(qsl)
    expanded = prefers_expanded(q_lens, layout.seq_lens - q_lens, dims)
    if not expanded.any():
        return ALL_ABSORBED
    token_expanded = np.repeat(expanded, q_lens)
    rows, absorbed_rows = np.flatnonzero(token_expanded), np.flatnonzero(~token_expanded)
    reqs = np.flatnonzero(expanded)
    seq_lens = layout.seq_lens[reqs].astype(np.int32)
    num_blocks = -(-seq_lens // layout.block_size)
    blocks = np.concatenate([layout.block_table[r, :n] for r, n in zip(reqs, num_blocks)]).astype(np.int64)
    block_table = np.zeros((len(reqs), int(num_blocks.max())), dtype=np.int32)
    for i, (start, n) in enumerate(zip(np.cumsum(num_blocks) - num_blocks, num_blocks)):
        block_table[i, :n] = np.arange(start, start + n)
    exp_qsl = np.concatenate([[0], np.cumsum(q_lens[reqs])]).astype(np.int32)
    rounded = -(-q_lens // layout.block_size) * layout.block_size
    _, _, views = pack_to_device([rows.astype(np.int64), blocks, exp_qsl, seq_lens, block_table,
                                  np.arange(len(reqs), dtype=np.int32), absorbed_rows.astype(np.int64)], device)
    absorbed_reqs = np.flatnonzero(~expanded)
    return MlaSplit(
        expanded=ExpandedRequests(*views[:6], max_query_len=int(q_lens[reqs].max()),
                                  query_start_loc_host=exp_qsl.tolist(), seq_lens_host=seq_lens.tolist(),
                                  pool_rows=len(blocks) * layout.block_size, row_budget=int(rounded.sum())),
        absorbed_rows=views[6],
        absorbed_metadata=(build_metadata(sub_layout(layout, absorbed_reqs, absorbed_rows), device)
                           if len(absorbed_reqs) else None),
    )


def expanded_kv(latent: torch.Tensor, projections: LatentProjections, heads: slice, kv_lora_rank: int,
                head_dim: int) -> torch.Tensor:
    """latent [num_blocks, block_size, L + R] (the expanded requests' gathered blocks, dequantized) -> those heads'
    keys and values as a paged K/V pool [2, num_blocks, block_size, len(heads), head_dim] (ExpandedRequests'
    block_table indexes it): K = [k_nope | k_pe], V zero-padded to head_dim, so that one head width serves both
    (the pad adds zeros to the output's padded columns only). Slots past a request's length decompress whatever
    the cache holds there; the attention never reads them."""
    num_blocks, block_size, width = latent.shape
    latent = latent.view(-1, width)
    kv = projections.expand_latent(latent[:, :kv_lora_rank], heads)  # [rows, heads, N + V]
    nope, value_dim = projections.qk_nope_head_dim, projections.v_head_dim
    pool = latent.new_zeros((2, latent.shape[0], kv.shape[1], head_dim))
    pool[0, :, :, :nope] = kv[..., :nope]
    pool[0, :, :, nope : nope + width - kv_lora_rank] = latent[:, None, kv_lora_rank:]  # one k_pe for every head
    pool[1, :, :, :value_dim] = kv[..., nope:]
    return pool.view(2, num_blocks, block_size, kv.shape[1], head_dim)


def forward_mla(backend, layer, q_nope: torch.Tensor, q_pe: torch.Tensor, projections: LatentProjections,
                kv_cache: torch.Tensor, metadata) -> torch.Tensor:
    """[num_tokens, H, V]: the absorbed requests through backend.latent_attention, the expanded ones through
    backend.expanded_attention. The new latent rows are already in the cache. metadata carries the step's host
    layout (`layout`) and a dict to keep the split in (`mla_splits`)."""
    dims = (layer.kv_lora_rank, projections.qk_nope_head_dim, layer.rope_dim, projections.v_head_dim)
    split = metadata.mla_splits.get(dims)
    if split is None:
        split = metadata.mla_splits[dims] = build_split(metadata.layout, dims, q_nope.device,
                                                        backend.build_metadata)
    if split.expanded is None:
        latent_out = backend.latent_attention(layer, projections.absorb_query(q_nope, q_pe), kv_cache, metadata)
        return projections.latent_to_values(latent_out)
    num_tokens, num_heads = q_nope.shape[:2]
    out = q_nope.new_zeros((num_tokens, num_heads, projections.v_head_dim))
    if split.absorbed_metadata is not None:
        rows = split.absorbed_rows
        query = projections.absorb_query(q_nope.index_select(0, rows), q_pe.index_select(0, rows))
        latent_out = backend.latent_attention(layer, query, kv_cache, split.absorbed_metadata)
        out.index_copy_(0, rows, projections.latent_to_values(latent_out))
    expanded = split.expanded
    nope, qk_dim = q_nope.shape[2], q_nope.shape[2] + q_pe.shape[2]
    head_dim = max(qk_dim, projections.v_head_dim)
    query = q_nope.new_zeros((len(expanded.rows), num_heads, head_dim))
    query[..., :nope] = q_nope.index_select(0, expanded.rows)
    query[..., nope:qk_dim] = q_pe.index_select(0, expanded.rows)
    latent = dequantize_kv(kv_cache.index_select(0, expanded.blocks), layer.k_scale, q_nope.dtype)
    step = expanded.heads_per_pass(num_heads)
    for first in range(0, num_heads, step):
        heads = slice(first, min(num_heads, first + step))
        pool = expanded_kv(latent, projections, heads, layer.kv_lora_rank, head_dim)
        head_out = backend.expanded_attention(query[:, heads].contiguous(), pool, expanded, layer.scale)
        out[:, heads].index_copy_(0, expanded.rows, head_out[..., : projections.v_head_dim])
    return out


def expanded_attention_ref(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
    kv_b_weight: torch.Tensor,  # [H * (N + V), L]
    q_nope: torch.Tensor,  # [num_tokens, H, N]
    q_pe: torch.Tensor,  # [num_tokens, H, R]
    query_start_loc: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,  # [num_reqs, max_blocks]
    scale: float,
    k_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, H, V] float64
    """MLA as the reference models compute it, per request in float64: every cached latent row decompressed by
    kv_b_proj's weight into per-head keys and values, causal softmax attention."""
    num_heads, nope, latent_dim = q_nope.shape[1], q_nope.shape[2], kv_cache.shape[2] - q_pe.shape[2]
    weight = kv_b_weight.double().cpu().view(num_heads, -1, latent_dim)
    w_k, w_v = weight[:, :nope], weight[:, nope:]
    block_size = kv_cache.shape[1]
    out = torch.zeros((*q_nope.shape[:2], w_v.shape[1]), dtype=torch.float64)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        blocks = block_table[i, : -(-seq_len // block_size)].long().cpu()
        rows = dequantize_kv(kv_cache.cpu()[blocks].reshape(-1, kv_cache.shape[2])[:seq_len],
                             None if k_scale is None else k_scale.cpu().double(), torch.float64)
        c_kv, k_pe = rows[:, :latent_dim], rows[:, latent_dim:]
        k_nope, value = torch.einsum("kl,hdl->hkd", c_kv, w_k), torch.einsum("kl,hdl->hkd", c_kv, w_v)
        scores = (torch.einsum("qhd,hkd->hqk", q_nope[start:end].cpu().double(), k_nope)
                  + torch.einsum("qhd,kd->hqk", q_pe[start:end].cpu().double(), k_pe)) * scale
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos[:, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,hkd->qhd", torch.softmax(scores, dim=-1), value)
    return out
