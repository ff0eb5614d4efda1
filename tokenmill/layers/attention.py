"""Attention layer over the paged KV cache; the backend of the current forward pass does the work."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.forward_context import get_forward_context


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        # [2, num_blocks, block_size, num_kv_heads, head_dim]; bound by the worker after sizing.
        self.kv_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [num_tokens, num_heads * head_dim], k/v [num_tokens, num_kv_heads * head_dim]."""
        ctx = get_forward_context()
        out = ctx.backend.forward(
            self,
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            ctx.attn_metadata,
        )
        return out.reshape(-1, self.num_heads * self.head_dim)
