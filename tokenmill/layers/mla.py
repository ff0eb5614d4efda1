"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over the paged latent KV cache: absorbed and expanded forms.

Each token's keys and values come from one latent c_kv (kv_lora_rank wide, RMS-normed) and one shared
rotary key k_pe (qk_rope_head_dim). kv_b_proj expands c_kv per head into k_nope and v; instead of expanding
the cached latents every step, its two halves are folded into the query and the output ("absorbed"):

    q_nope . k_nope = q_nope . (W_UK c_kv) = (W_UK^T q_nope) . c_kv
    sum_j p_j v_j   = W_UV (sum_j p_j c_kv_j)

So attention runs in the latent space as multi-query attention with one KV head of width
kv_lora_rank + qk_rope_head_dim (576 for the released models): K = [c_kv | k_pe], query = [W_UK^T q_nope | q_pe],
and the first kv_lora_rank dims of the output go through W_UV per head, then o_proj. That is the cheap form for
decodes; for prompts and large prefill chunks the expanded form is: the cached latents of the request's keys
decompressed by kv_b_proj into per-head k_nope and v, and ordinary causal attention with 192-wide keys and
128-wide values instead of 576 and 512 (attention.mla_split picks the form per request by its cost, and splits
a mixed step's rows between them).

The rotary embedding is applied here, to the 64-wide pe parts only, and the Attention layer gets none:
DeepSeek lays the rotary pairs out interleaved (x0, x1), (x2, x3)... (V2 always; V3 unless
rope_interleave is false), which the layer's rotate-half rotary cannot express, and rotating the pe parts
before they are concatenated leaves the latent untouched. What this gives up is the GPU kernel that fuses
the rotary with the KV write (a plain KV write runs instead).

The cache (LatentAttention) holds one row [c_kv | k_pe] per token and layer, no separate V: the c_kv part of
the row is the value. The layer declares that shape to the worker (kv_cache_shape), and the backends attend
over it with their forward_mla: absorbed, the Triton kernels of kernels.mla_decode / kernels.mla_cache on the
GPU, on the CPU the generic paths over a view that reads the row as both K and V; expanded, the backends'
ordinary prefill attention over the decompressed keys and values. Both read the same cache, written once.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from tokenmill.distributed.parallel_state import get_tp_size
from tokenmill.forward_context import get_forward_context
from tokenmill.layers.attention import Attention
from tokenmill.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.quant.unquantized import UnquantizedLinearMethod
from tokenmill.layers.rotary import RotaryEmbedding, max_rope_positions, rope_parameters

# transformers' DeepSeek attention builds q_a_layernorm and kv_a_layernorm with the default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(config: PretrainedConfig) -> float:
    """1 / sqrt(qk_nope + qk_rope) (the expanded head's width, not the latent's), times yarn's mscale^2
    when the rope is scaled and the config names mscale_all_dim."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        mscale = yarn_mscale(params["factor"], params["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d] with rotary pairs (x0, x1), (x2, x3)... -> [x0, x2, ... | x1, x3, ...], the rotate-half layout.
    q and k get the same permutation, so their dot product is unchanged."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class LatentAttention(Attention):
    """MLA's attention in the latent space: multi-query, every head over one cached row [c_kv | k_pe] per token
    (the keys; their c_kv part the values). The cache is [num_blocks, block_size, kv_lora_rank + rope_dim]."""

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float) -> None:
        super().__init__(num_heads, kv_lora_rank + rope_dim, scale, num_kv_heads=1)
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.head_dim)

    def copy_kv_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.kv_cache[dst] = self.kv_cache[src]

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                projections: MultiHeadLatentAttention) -> torch.Tensor:
        """q_nope [num_tokens, num_heads, qk_nope], q_pe [num_tokens, num_heads, rope_dim] (rotated), c_kv
        [num_tokens, kv_lora_rank] (normed), k_pe [num_tokens, rope_dim] (rotated) -> [num_tokens, num_heads,
        v_head_dim], the values before o_proj. projections: the absorbed and expanded forms' weights."""
        ctx = get_forward_context()
        return ctx.backend.forward_mla(self, q_nope, q_pe, c_kv, k_pe, projections, self.kv_cache, ctx.attn_metadata)


class MultiHeadLatentAttention(nn.Module):
    """Module names mirror transformers' DeepseekV2Attention / DeepseekV3Attention, so checkpoints load by name."""

    def __init__(self, config: PretrainedConfig, rope_interleaved: bool) -> None:
        super().__init__()
        tp_size = get_tp_size()
        total_heads = config.num_attention_heads
        if total_heads % tp_size:
            raise ValueError(f"{total_heads} attention heads do not split over {tp_size} tensor-parallel ranks")
        self.num_heads = total_heads // tp_size
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.rope_interleaved = rope_interleaved
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = getattr(config, "attention_bias", False)
        hidden = config.hidden_size
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, total_heads * qk_head_dim)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_heads * qk_head_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank,
                                              total_heads * (self.qk_nope_head_dim + self.v_head_dim))
        self.o_proj = RowParallelLinear(total_heads * self.v_head_dim, hidden, bias=bias)
        self.rotary_emb = RotaryEmbedding(config, self.qk_rope_head_dim, max_rope_positions(config),
                                          rotary_dim=self.qk_rope_head_dim)
        self.latent_dim = self.kv_lora_rank + self.qk_rope_head_dim
        # One KV head per token: the latent and the rotary key; every query head attends to it.
        self.attn = LatentAttention(self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim, mla_softmax_scale(config))
        self._dense_kv_b: torch.Tensor | None = None  # a quantized kv_b_proj's weight in float, made on first use

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """positions [num_tokens]; hidden_states [num_tokens, hidden_size] -> [num_tokens, hidden_size]."""
        num_tokens = hidden_states.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(num_tokens, self.num_heads, -1)  # [num_tokens, num_heads, qk_nope + qk_rope]
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_proj_with_mqa(hidden_states)  # [num_tokens, kv_lora_rank + qk_rope]
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe, k_pe = self._rotate(positions, q_pe, k_pe.unsqueeze(1))
        values = self.attn(q_nope, q_pe, c_kv, k_pe.squeeze(1), self)  # [num_tokens, num_heads, v_head_dim]
        return self.o_proj(values.reshape(num_tokens, self.num_heads * self.v_head_dim))

    def absorb_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """[n, num_heads, qk_nope], [n, num_heads, qk_rope] -> [n, num_heads, latent_dim]: [W_UK^T q_nope | q_pe]."""
        w_uk, _ = self._absorbed_weights()
        # [num_heads, n, qk_nope] @ [num_heads, qk_nope, kv_lora_rank]: each head's query in the latent space
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        return torch.cat([q_latent, q_pe], dim=-1)

    def latent_to_values(self, latent_out: torch.Tensor) -> torch.Tensor:
        """[n, num_heads, kv_lora_rank] -> [n, num_heads, v_head_dim]: through W_UV."""
        _, w_uv = self._absorbed_weights()
        # [num_heads, n, kv_lora_rank] @ [num_heads, kv_lora_rank, v_head_dim]
        return torch.bmm(latent_out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def expand_latent(self, c_kv: torch.Tensor, heads: slice) -> torch.Tensor:
        """[n, kv_lora_rank] -> [n, len(heads), qk_nope + v_head_dim]: those heads' [k_nope | v] (the expanded form),
        kv_b_proj's rows for them (a quantized layer's weight as the absorbed form reads it)."""
        weight = self._kv_b_weight()[heads]  # [heads, qk_nope + v_head_dim, kv_lora_rank], contiguous rows
        return F.linear(c_kv, weight.reshape(-1, self.kv_lora_rank)).view(c_kv.shape[0], weight.shape[0], -1)

    def _rotate(self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q_pe [num_tokens, num_heads, qk_rope], k_pe [num_tokens, 1, qk_rope], rotated (rotate-half layout)."""
        if self.rope_interleaved:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        return self.rotary_emb(positions, q_pe, k_pe)

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's heads' (W_UK [num_heads, qk_nope, kv_lora_rank], W_UV [num_heads, v_head_dim, kv_lora_rank])."""
        weight = self._kv_b_weight()
        return weight[:, : self.qk_nope_head_dim], weight[:, self.qk_nope_head_dim :]

    def _kv_b_weight(self) -> torch.Tensor:
        """This rank's kv_b_proj weight in float, [num_heads, qk_nope + v_head_dim, kv_lora_rank]."""
        if isinstance(self.kv_b_proj.quant_method, UnquantizedLinearMethod):
            weight = self.kv_b_proj.weight  # views of the loaded weight: nothing is copied, nothing goes stale
        else:
            if self._dense_kv_b is None:
                if getattr(self.kv_b_proj, "input_scale", None) is not None:
                    raise ValueError("kv_b_proj has a static activation scale, which would round the identity "
                                     "rows its weight is read back through for MLA's absorption")
                # Any quant method's weight, through its own matmul: identity rows give W^T.
                eye = torch.eye(self.kv_lora_rank, dtype=self.kv_a_layernorm.weight.dtype,
                                device=self.kv_a_layernorm.weight.device)
                self._dense_kv_b = self.kv_b_proj(eye).t().contiguous()
            weight = self._dense_kv_b
        return weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
