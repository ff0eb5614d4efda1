"""The CPU decoder-layer step (model.cpu_layer_step) against the layer's module path: the same outputs, residual
and KV cache, bit for bit, in float32 and bfloat16, for decodes, a prefill chunk beside them, and draft trees."""

import pytest
import torch
from transformers import LlamaConfig

from tests.unit.test_cpu_attention_kernel import make_layout
from tokenmill.attention.cpu_kernel import load_kernel
from tokenmill.attention.torch_attn import TorchAttentionBackend
from tokenmill.forward_context import forward_context
from tokenmill.layers import cpu_norm
from tokenmill.model.cpu_layer_step import CpuLayerStep
from tokenmill.model.llama import LlamaDecoderLayer, PreNormDecoderLayer

pytestmark = pytest.mark.skipif(load_kernel() is None or cpu_norm.load_kernels() is None,
                                reason="no C compiler: the layer takes its module path")


def make_layer(dtype: torch.dtype, qkv_bias: bool = False) -> LlamaDecoderLayer:
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as the loader builds a model: parameters in dtype, the rotary table float32
    try:
        layer = LlamaDecoderLayer(config, 0, qkv_bias=qkv_bias, o_bias=False, qk_norm=False)  # Qwen2's biases
    finally:
        torch.set_default_dtype(default)
    g = torch.Generator().manual_seed(0)
    for name, param in layer.named_parameters():
        noise = torch.randn(param.shape, generator=g)
        param.data.copy_(1 + 0.1 * noise if "norm" in name else noise / 8)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
# tree_lens: draft-tree nodes ending each request's keys (test_cpu_attention_kernel.TREE's first ones)
@pytest.mark.parametrize("q_lens,context_lens,tree_lens", [([1], [9], None), ([1, 1, 5], [20, 3, 0], None),
                                                           ([1, 4, 1], [20, 11, 3], [0, 3, 2])],
                         ids=["decode", "mixed", "tree"])
@pytest.mark.parametrize("first_layer", [True, False], ids=["no_residual", "residual"])
def test_step_equals_the_module_path(dtype, q_lens, context_lens, tree_lens, first_layer):
    layer = make_layer(dtype, qkv_bias=len(q_lens) > 1)
    layout = make_layout(q_lens, context_lens, 16, 16, tree_lens)
    metadata = TorchAttentionBackend().build_metadata(layout, torch.device("cpu"))
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(context_lens, q_lens)])
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(len(positions), 64, generator=g).to(dtype)
    residual = None if first_layer else torch.randn(len(positions), 64, generator=g).to(dtype)
    pool = torch.randn(2, 16, 16, 2, 16, generator=g).to(dtype)

    results = []
    with torch.no_grad(), forward_context(TorchAttentionBackend(), metadata):
        assert CpuLayerStep.for_layer(layer, hidden) is not None, "the plain layer must take the step"
        for forward in (layer.forward, lambda *args: PreNormDecoderLayer.forward(layer, *args)):
            layer.self_attn.attn.kv_cache = pool.clone()
            out, new_residual = forward(positions, hidden, residual)
            results.append((out, new_residual, layer.self_attn.attn.kv_cache))
    for step_value, module_value in zip(*results):
        assert torch.equal(step_value, module_value)


def test_hooks_keep_the_module_path():
    layer = make_layer(torch.float32)
    hidden = torch.zeros(1, 64)
    assert CpuLayerStep.for_layer(layer, hidden) is not None
    layer.mlp.down_proj.register_forward_hook(lambda *args: None)
    layer.__dict__.pop("_cpu_layer_step")  # decided once per dtype: decide afresh with the hook
    assert CpuLayerStep.for_layer(layer, hidden) is None
