"""Attention layer over the paged KV cache; the backend of the current forward pass does the work.

The layer takes q/k/v as projected. What the model does to q and k before attention (per-head RMSNorm,
rotary embedding) is handed to the layer as modules, so that the backend can apply them where it writes
the KV cache: the Triton backend fuses them with that write (one kernel), the torch backend applies them
as they are (transform_qk).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.forward_context import get_forward_context
from tokenmill.kernels.kv_int8 import SCALE_DTYPE, is_int8, scale_shape
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding


def load_kv_scale(buffer: torch.Tensor, loaded: torch.Tensor) -> None:
    """A checkpoint's per-layer k_scale / v_scale (one value, maybe as shape [1]) into its 0-d buffer."""
    if loaded.numel() != 1:
        raise ValueError(f"KV cache scales must be one value per layer; got shape {tuple(loaded.shape)} "
                         f"(per-head scales are not supported)")
    value = float(loaded.reshape(()).float())
    if not value > 0.0 or value == float("inf"):
        raise ValueError(f"a KV cache scale must be positive and finite, got {value}")
    buffer.fill_(value)


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        rotary_emb: RotaryEmbedding | None = None,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        # Plain references, not submodules: the model owns these modules, and their parameters keep the
        # names the checkpoint gives them (self_attn.q_norm.weight).
        object.__setattr__(self, "rotary_emb", rotary_emb)
        object.__setattr__(self, "q_norm", q_norm)
        object.__setattr__(self, "k_norm", k_norm)
        # kv_cache_shape(): [2, num_blocks, block_size, num_kv_heads, head_dim]; bound by the worker after sizing.
        self.kv_cache = torch.empty(0)
        # An fp8 pool's per-layer scales (attention.kv_quant). Buffers rather than parameters: a checkpoint
        # without them is complete, and dummy weights leave them at 1.0. An int8 pool replaces them with its
        # per-row scales while it is bound (allocate_kv_cache).
        for name in ("k_scale", "v_scale"):
            self.register_buffer(name, torch.ones((), dtype=torch.float32), persistent=False)
            getattr(self, name).weight_loader = load_kv_scale

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The shape of this layer's paged pool, which the worker allocates (and sizes through
        kv_cache_bytes_per_token): K and V of every slot. A layer with another cache layout overrides this, its
        bytes per token and copy_kv_blocks (layers.mla.LatentAttention: one latent row per token)."""
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def kv_cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        """The pool's bytes per token, an int8 pool's scales (K and V, one per KV head) included."""
        scales = 2 * math.prod(scale_shape(1, 1, self.num_kv_heads)) * SCALE_DTYPE.itemsize if is_int8(dtype) else 0
        return math.prod(self.kv_cache_shape(1, 1)) * dtype.itemsize + scales

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                          zeroed: bool = False) -> None:
        """Bind a new pool of `dtype` to the layer; an int8 pool's K and V scales (kernels.kv_int8) come with it,
        indexed by the same blocks, so that whatever a block id reaches (prefix-cache hits, reuse, the copies of
        copy_kv_blocks) takes the scales along."""
        alloc = torch.zeros if zeroed else torch.empty
        self.kv_cache = alloc(self.kv_cache_shape(num_blocks, block_size), dtype=dtype, device=device)
        if is_int8(dtype):
            scales = alloc((2, *scale_shape(num_blocks, block_size, self.num_kv_heads)), dtype=SCALE_DTYPE,
                           device=device)
            self.k_scale, self.v_scale = scales[0], scales[1]

    def release_kv_cache(self) -> None:
        """Unbind the pool (and an int8 pool's scales; an fp8 pool's per-layer scales stay the checkpoint's)."""
        if is_int8(self.kv_cache.dtype):
            self.k_scale, self.v_scale = (torch.ones((), dtype=torch.float32, device=self.k_scale.device)
                                          for _ in range(2))
        self.kv_cache = torch.empty(0)

    def move_kv_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V at pool slots `src` to slots `dst` (int64, on the pool's device), with an int8 pool's row
        scales: all read before any is written, so the two may overlap (a verified draft tree's accepted path)."""
        flat = self.kv_cache.view(2, -1, *self.kv_cache.shape[3:])
        flat[:, dst] = flat[:, src]
        if is_int8(self.kv_cache.dtype):
            for scales in (self.k_scale, self.v_scale):
                rows = scales.view(-1, self.num_kv_heads)
                rows[dst] = rows[src]

    def copy_kv_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the pool's blocks `src` onto `dst` (int64 block ids on the pool's device), with their scales."""
        self.kv_cache[:, dst] = self.kv_cache[:, src]
        if is_int8(self.kv_cache.dtype):
            for scales in (self.k_scale, self.v_scale):
                scales[dst] = scales[src]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """positions [num_tokens]; q [num_tokens, num_heads * head_dim], k/v [num_tokens, num_kv_heads * head_dim]."""
        ctx = get_forward_context()
        out = ctx.backend.forward(
            self,
            positions,
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            ctx.attn_metadata,
        )
        return out.reshape(-1, self.num_heads * self.head_dim)

    def transform_qk(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim] normed per head,
        then rotated: the unfused path, module by module."""
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        return q, k
