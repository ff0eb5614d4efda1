"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama architecture with fused projections in the checkpoint.

The checkpoint stores qkv_proj and gate_up_proj already fused (and, in HF's layout, in the same
[q | k | v] and [gate | up] order our fused layers use), so the Llama modules load it as is:
the fused layers' weight loaders split such tensors themselves when shard_id is None, which also
gives each tensor-parallel rank its own heads. A config's sliding_window applies to every layer,
and partial_rotary_factor and LongRoPE scaling (Phi-3.5, Phi-4-mini) are RotaryEmbedding's.
"""

from __future__ import annotations

from tokenmill.model.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    qkv_bias = o_bias = mlp_bias = False
