"""A Llama decoder layer's step on the CPU, with less Python between its C kernels.

At batch 1 on the CPU the Python around a layer's kernels (eleven module calls, each wrapper's checks, the
attention backend's dispatch) costs about as much as the kernels themselves (BENCHMARKS.md, issue 23). For a
layer built of the plain parts (RMSNorms with their C kernel, linear layers on one rank, the rotary
embedding without q/k norms, the gated MLP), CpuLayerStep runs the same computations from one function:
the two norms' C kernel directly, each linear through its quant method's apply (what its module's forward
calls), the rotary embedding, KV write and paged attention as one C call (attention.cpu_kernel), the
activation module's forward. What is fixed per layer is gathered once. The kernels and their arguments are
those of the module path, so outputs are bit-identical at any row count (the gain is at a few rows: decodes).
An attention step the fused kernel does not take (an fp8 or int8 pool, another backend, positions past the
rotary table) goes through the layer's Attention module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.nn.modules import module as nn_module

from tokenmill.attention.cpu_kernel import heads_fit, load_kernel, pool_pointers, rope_table_length, tree_pointers
from tokenmill.attention.torch_attn import TorchAttentionBackend
from tokenmill.distributed.parallel_state import get_tp_size
from tokenmill.forward_context import get_forward_context
from tokenmill.layers import cpu_norm
from tokenmill.layers.norm import RMSNorm


def _has_hooks(modules) -> bool:
    return (any(m._forward_hooks or m._forward_pre_hooks for m in modules)
            or bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks))


class CpuLayerStep:
    """The step of one LlamaDecoderLayer for one dtype; build with for_layer()."""

    def __init__(self, layer, dtype: torch.dtype) -> None:
        attn_module, mlp = layer.self_attn, layer.mlp
        self.dtype, self.is_bf16 = dtype, dtype == torch.bfloat16
        # Each norm's parameters (read per call: a reload that replaces the weight is seen), eps and offset.
        self.norms = tuple((n._parameters, n.eps, n.offset)
                           for n in (layer.input_layernorm, layer.post_attention_layernorm))
        self.rms_norm = cpu_norm.load_kernels().rms_norm
        linears = (attn_module.qkv_proj, attn_module.o_proj, mlp.gate_up_proj, mlp.down_proj)
        self.qkv, self.o, self.gate_up, self.down = (_linear_call(linear) for linear in linears)
        self.act = mlp.act_fn.forward
        self.attn = attn_module.attn
        self.q_size, self.kv_size = attn_module.q_size, attn_module.kv_size
        self.heads, self.kv_heads, self.head_dim = attn_module.num_heads, attn_module.num_kv_heads, attn_module.head_dim
        self.attention = load_kernel().rope_cache_attention
        self.elem = dtype.itemsize

    @staticmethod
    def for_layer(layer, hidden_states: torch.Tensor) -> CpuLayerStep | None:
        """The layer's step for these hidden states' dtype, or None where the layer is not of the plain parts (or a
        kernel is missing); decided once per dtype."""
        dtype = hidden_states.dtype
        decided = layer.__dict__.get("_cpu_layer_step")
        if decided is None or decided[0] is not dtype:
            decided = (dtype, CpuLayerStep(layer, dtype) if _plain(layer, dtype) else None)
            layer.__dict__["_cpu_layer_step"] = decided
        return decided[1]

    def __call__(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """As PreNormDecoderLayer.forward, for contiguous hidden_states [rows, hidden] (and residual)."""
        threads = torch.get_num_threads()
        rows = hidden_states.shape[0]
        h, residual = self._norm(0, hidden_states, residual, threads)
        attn_out = self._attention(positions, self.qkv(h), rows, threads)
        h, residual = self._norm(1, self.o(attn_out).contiguous(), residual, threads)
        return self.down(self.act(self.gate_up(h))), residual

    def _norm(self, index: int, x: torch.Tensor, residual: torch.Tensor | None,
              threads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Norm `index` of the layer on x (after adding the residual, when there is one): (normed, new residual)."""
        params, eps, offset = self.norms[index]
        rows, hidden = x.shape
        h = torch.empty_like(x)
        if residual is None:
            self.rms_norm(h.data_ptr(), None, x.data_ptr(), None, params["weight"].data_ptr(), rows, hidden, eps,
                          offset, self.is_bf16, threads)
            return h, x
        new_residual = torch.empty_like(x)
        self.rms_norm(h.data_ptr(), new_residual.data_ptr(), x.data_ptr(), residual.data_ptr(),
                      params["weight"].data_ptr(), rows, hidden, eps, offset, self.is_bf16, threads)
        return h, new_residual

    def _attention(self, positions: torch.Tensor, qkv: torch.Tensor, rows: int, threads: int) -> torch.Tensor:
        """[rows, q_size]: the backend's CPU route (TorchAttentionBackend.forward) for qkv's rows."""
        ctx = get_forward_context()
        layer, metadata = self.attn, ctx.attn_metadata
        kv_cache = layer.kv_cache
        pointers = pool_pointers(kv_cache) if kv_cache.dtype == self.dtype else None
        # TorchAttentionBackend.forward's checks for the fused kernel, less what the step's build decided
        if (pointers is None or type(ctx.backend) is not TorchAttentionBackend or positions.dtype != torch.int64
                or metadata.max_seq_len > rope_table_length(layer) or qkv.stride(1) != 1):
            q, k, v = qkv.split_with_sizes([self.q_size, self.kv_size, self.kv_size], dim=-1)
            return layer(positions, q, k, v)
        step = _step_arguments(metadata, positions)
        out = torch.empty((rows, self.q_size), dtype=self.dtype)
        base, stride = qkv.data_ptr(), qkv.stride(0)
        status = self.attention(
            out.data_ptr(), base, base + self.q_size * self.elem, base + (self.q_size + self.kv_size) * self.elem,
            step.positions, layer.rotary_emb.cos_sin_cache.data_ptr(), step.slot_mapping, *pointers,
            step.block_table, step.query_start_loc, step.seq_lens, step.num_reqs, rows, self.heads, self.kv_heads,
            self.head_dim, layer.rotary_emb.rotary_dim, kv_cache.shape[2], step.block_table_stride, stride, stride,
            stride, self.q_size, layer.scale, layer.sliding_window or 0, layer.logits_soft_cap or 0.0,
            self.is_bf16, threads, step.tree_lens, step.tree_bits,
        )
        assert status == 0, "the step's build admits only heads within the kernel's limits"
        return out


class _StepArguments(NamedTuple):
    """What every layer's attention call of one forward pass shares (pointers, int64 tensors)."""

    tensors: tuple  # what the pointers point into, kept alive; the first is the positions as given
    positions: int
    slot_mapping: int
    block_table: int
    query_start_loc: int
    seq_lens: int
    num_reqs: int
    block_table_stride: int
    tree_lens: int | None  # the draft trees' masks (None: no trees)
    tree_bits: int | None


def _step_arguments(metadata, positions: torch.Tensor) -> _StepArguments:
    """The forward pass's _StepArguments, gathered by its first layer and kept on its metadata."""
    cached = metadata.__dict__.get("_cpu_step_arguments")
    if cached is not None and cached.tensors[0] is positions:
        return cached
    tensors = (positions, positions.contiguous(), metadata.slot_mapping.contiguous(), metadata.block_table.contiguous(),
               metadata.query_start_loc_cpu, metadata.seq_lens_cpu, metadata.tree_lens_cpu, metadata.tree_bits)
    cached = _StepArguments(tensors, *(t.data_ptr() for t in tensors[1:6]), tensors[5].shape[0], tensors[3].stride(0),
                            *tree_pointers(metadata.tree_lens_cpu, metadata.tree_bits))
    metadata.__dict__["_cpu_step_arguments"] = cached
    return cached


def _linear_call(linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> the linear layer's output, as its forward computes it on one rank: its quant method's apply with its
    bias (read per call, as the module reads it)."""
    apply, params = linear.quant_method.apply, linear._parameters
    return lambda x: apply(linear, x, params["bias"])


def _plain(layer, dtype: torch.dtype) -> bool:
    """Whether the layer is built of the parts CpuLayerStep runs (its types exactly: a subclass may compute
    otherwise), its norms and attention kernels are there, and no hook expects its modules to be called."""
    from tokenmill.model.llama import LlamaAttention, LlamaMLP

    attn_module, mlp = layer.self_attn, layer.mlp
    if type(attn_module) is not LlamaAttention or type(mlp) is not LlamaMLP or get_tp_size() != 1:
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    linears = (attn_module.qkv_proj, attn_module.o_proj, mlp.gate_up_proj, mlp.down_proj)
    attn = attn_module.attn
    return (dtype in (torch.float32, torch.bfloat16)
            and all(type(n) is RMSNorm and n.weight.dtype == dtype and n.weight.is_contiguous() for n in norms)
            and attn.rotary_emb is not None and attn.q_norm is None and attn.k_norm is None
            and attn.num_heads * attn.head_dim == attn_module.q_size and attn.num_heads % attn.num_kv_heads == 0
            and heads_fit(attn.num_heads, attn.head_dim)
            and cpu_norm.load_kernels() is not None and load_kernel() is not None
            and not _has_hooks([layer, attn_module, mlp, attn, mlp.act_fn, *norms, *linears]))
