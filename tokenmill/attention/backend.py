"""AttentionBackend: the model <-> attention contract.

A backend turns the step's batch layout into its own metadata once per step, then runs every
attention layer with it: apply the layer's q/k norms and rotary embedding, write the new K/V into
the paged pool by slot, and attend over each request's blocks through its block table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from tokenmill.attention.mla_split import ExpandedRequests, LatentProjections
    from tokenmill.layers.attention import Attention
    from tokenmill.layers.mla import LatentAttention


@dataclass
class BatchLayout:
    """Where each request's tokens sit in the flat batch; built on the host by the model runner."""

    query_start_loc: np.ndarray
    """[num_reqs + 1] int32: request i owns flat tokens [query_start_loc[i], query_start_loc[i+1])."""
    seq_lens: np.ndarray
    """[num_reqs] int32: tokens in the cache for each request once this step's are written."""
    block_table: np.ndarray
    """[num_reqs, max_blocks_per_req] int32: physical block of each logical block."""
    slot_mapping: np.ndarray
    """[num_tokens] int64: pool slot (block * block_size + offset) each new token's K/V goes to."""
    block_size: int
    tree_lens: np.ndarray | None = None
    """[num_reqs] int32: speculative draft-tree nodes at the end of each request's keys (spec/tree.py), 0 for
    none; a request with nodes goes to the prefill kernel whatever its query length. None: no tree this step."""
    tree_bits: np.ndarray | None = None
    """[num_tokens] int64: the tree nodes each query sees beside the keys before them (bit i: node i)."""

    def decode_requests(self) -> np.ndarray:
        """[num_reqs] bool: the requests the decode kernels take: one query token and no draft-tree nodes."""
        is_decode = np.diff(self.query_start_loc) == 1
        if self.tree_lens is not None:
            is_decode &= self.tree_lens == 0
        return is_decode


class FixedShape(NamedTuple):
    """The shape a full-step CUDA graph is captured for. Metadata padded to it (build_metadata's `padded_to`)
    launches its kernels on grids fixed by it, so that one graph serves every step that fits."""

    num_tokens: int
    num_decodes: int
    """Slots for requests of one query token."""
    num_prefills: int
    """Slots for the others (prompt chunks, verified drafts)."""
    num_block_columns: int


class AttentionBackend(ABC):
    name: str
    supports_cuda_graphs: bool = False
    """Whether forward() is capturable: no host syncs, and copy_metadata() is implemented."""
    supports_mixed_cuda_graphs: bool = False
    """Whether build_metadata(layout, device, padded_to=FixedShape(...)) gives metadata whose kernels launch on
    grids fixed by that shape, so that one graph serves any step with prefills that fits."""

    supports_device_positions: bool = False
    """Whether place_decodes() is implemented: decode positions known only on the device (no host sync)."""

    @abstractmethod
    def build_metadata(self, layout: BatchLayout, device: torch.device) -> object:
        """Per-step metadata shared by every layer (tensors on the device, host copies as needed)."""

    def place_decodes(self, metadata: object, positions: torch.Tensor, block_size: int,
                      block_table: torch.Tensor | None = None, padded: bool = False) -> None:
        """Move the metadata's first len(positions) requests, one query token each and built for positions at or
        past these, to `positions` [n] int64 on the device: their context lengths and KV slots (the block
        tables must reach the built positions). A drafter's steps after a verification whose accepted counts
        are still on the device (spec/eagle.py). `block_table` [n, width] on the device: the requests' block
        tables, written in first (a graph built for no request in particular: worker/chain_draft_graph.py);
        `padded`: a negative position is a padding request, which stores nothing and attends to nothing."""
        raise NotImplementedError(f"the {self.name} attention backend takes positions from the host only")

    @abstractmethod
    def forward(
        self,
        layer: Attention,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: object,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """query/key as projected: transform them as layer.transform_qk does (norms, rotary; fused or not),
        store key/value into the pool at the step's slots, then attend."""

    def forward_mla(
        self,
        layer: LatentAttention,
        q_nope: torch.Tensor,  # [num_tokens, num_heads, qk_nope]
        q_pe: torch.Tensor,  # [num_tokens, num_heads, rope_dim], rotated
        c_kv: torch.Tensor,  # [num_tokens, kv_lora_rank], normed
        k_pe: torch.Tensor,  # [num_tokens, rope_dim], rotated
        projections: LatentProjections,  # the model's MLA module: W_UK, W_UV, kv_b_proj
        kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
        metadata: object,
    ) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
        """Multi-head latent attention (layers.mla): store each new token's latent row [c_kv | k_pe] at its slot,
        then attend, each request in the absorbed or the expanded form (attention.mla_split.forward_mla, which
        calls latent_attention and expanded_attention below)."""
        raise NotImplementedError(f"attention backend {self.name!r} has no multi-head latent attention")

    def latent_attention(self, layer: LatentAttention, query: torch.Tensor, kv_cache: torch.Tensor,
                         metadata: object) -> torch.Tensor:
        """MLA's absorbed form: query [n, num_heads, kv_lora_rank + rope_dim] ([W_UK^T q_nope | q_pe]) attends
        (causal) over its requests' latent rows, which are the keys, their c_kv part the values
        -> [n, num_heads, kv_lora_rank]."""
        raise NotImplementedError(f"attention backend {self.name!r} has no multi-head latent attention")

    def expanded_attention(self, query: torch.Tensor, pool: torch.Tensor, expanded: ExpandedRequests,
                           scale: float) -> torch.Tensor:
        """MLA's expanded form, for some of the heads: causal multi-head attention of query [n, heads, head_dim]
        over the decompressed pool [2, num_blocks, block_size, heads, head_dim] (attention.mla_split.expanded_kv),
        laid out as `expanded` says -> [n, heads, head_dim]."""
        raise NotImplementedError(f"attention backend {self.name!r} has no multi-head latent attention")

    def copy_metadata(self, dst: object, src: object) -> None:
        """Graph-capture hook: copy a step's metadata into a captured graph's static metadata
        (both built by build_metadata for the same padded batch shape)."""
        raise NotImplementedError(f"attention backend {self.name!r} does not support CUDA graphs")


def get_attention_backend(name: str | None, device: torch.device) -> AttentionBackend:
    from tokenmill.attention.torch_attn import TorchAttentionBackend

    backends: dict[str, type[AttentionBackend]] = {"torch": TorchAttentionBackend}
    if device.type == "cuda":
        try:
            from tokenmill.attention.triton_attn import TritonAttentionBackend

            backends["triton"] = TritonAttentionBackend
        except ImportError:
            pass
    default = "triton" if "triton" in backends else "torch"
    name = name or default
    if name not in backends:
        raise ValueError(f"attention backend {name!r} is not available here; choose from {sorted(backends)}")
    return backends[name]()
