"""Per-token FP8 quantization fused into the kernels before an FP8 linear layer (kernels.activation's
silu_and_mul_fp8, kernels.rms_norm's rms_norm_fp8) against the unfused pair, quantize_fp8 of the 16-bit
output: the same e4m3 bits and the same scales. Under the interpreter both sides convert to e4m3 and
bfloat16 its own (wrong) way, and alike, so the comparison still holds there."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.quant.fp8 import FP8, Fp8Activation, Fp8Config

gpu, interpret = pytest.mark.gpu, pytest.mark.interpret
DTYPES = [torch.bfloat16, torch.float16]


def _rows(num_rows: int, width: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(num_rows, width, generator=g)
    x[1] = 0  # an all-zero row takes the floor scale
    return x.to(dtype).to(device)


def _assert_same_quantization(got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]):
    (q, scale), (q_ref, scale_ref) = got, ref
    assert q.dtype == FP8 and scale.shape == scale_ref.shape
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scale, scale_ref)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [pytest.param(1001, marks=interpret), 14336])  # odd; Llama-3.1-8B's down_proj
def test_silu_and_mul_fp8_is_quantize_fp8_of_silu_and_mul(device, dtype, d):
    from tokenmill.kernels.activation import silu_and_mul, silu_and_mul_fp8
    from tokenmill.kernels.fp8_gemm import quantize_fp8

    x = _rows(5, 2 * d, dtype, device, seed=d)
    _assert_same_quantization(silu_and_mul_fp8(x), quantize_fp8(silu_and_mul(x)))


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("hidden", [pytest.param(999, marks=interpret), 4096])
def test_rms_norm_fp8_is_quantize_fp8_of_rms_norm(device, dtype, residual, offset, hidden):
    from tokenmill.kernels.fp8_gemm import quantize_fp8
    from tokenmill.kernels.rms_norm import rms_norm, rms_norm_fp8

    x = _rows(4, hidden, dtype, device, seed=hidden)
    w = (1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(1))).to(dtype).to(device)
    r = _rows(4, hidden, dtype, device, seed=hidden + 1) if residual else None
    q, scale, residual_out = rms_norm_fp8(x, w, 1e-6, offset, r)
    ref = rms_norm(x, w, 1e-6, offset, r)
    out_ref = ref[0] if residual else ref
    _assert_same_quantization((q, scale), quantize_fp8(out_ref))
    if residual:
        assert torch.equal(residual_out, ref[1])
    else:
        assert residual_out is None


def _make_fp8(layer, seed: int):
    """An online FP8 layer (per-channel scales) with random weights."""
    layer.set_quant_method(Fp8Config.online().linear_method("layer"))
    g = torch.Generator().manual_seed(seed)
    layer.weight_loader(layer.weight, torch.randn(layer.weight.shape, generator=g) * layer.input_size**-0.5)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _fp8_layer(k: int, n: int, device: str):
    from tokenmill.layers.linear import RowParallelLinear

    layer = _make_fp8(RowParallelLinear(k, n, bias=True), seed=k)
    layer.bias.data = torch.randn(n).to(torch.bfloat16)  # the activations' dtype, as cuBLASLt wants
    return layer.to(device)


@gpu
@pytest.mark.parametrize("rows,k,n", [(17, 4096, 4096), (300, 1024, 512), (3, 1024, 512)])
def test_fp8_linear_takes_its_input_quantized(rows, k, n):
    """A layer asks for pre-quantized input exactly where it would quantize per token itself, and then gives
    the same output bit for bit."""
    from tokenmill.kernels.fp8_gemm import quantize_fp8

    if not torch.cuda.is_available():
        pytest.skip("torch._scaled_mm needs a GPU")
    layer = _fp8_layer(k, n, "cuda")
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16).cuda()
    assert layer.quant_method.fp8_input_wanted(layer, x)
    assert not layer.quant_method.fp8_input_wanted(layer, x[:16] if k >= 4096 else x[:0])
    assert torch.equal(layer(Fp8Activation(*quantize_fp8(x), x.dtype)), layer(x))


def test_fp8_input_is_never_wanted_on_the_cpu():
    layer = _fp8_layer(1024, 512, "cpu")
    x = torch.randn(300, 1024).to(torch.bfloat16)
    assert not layer.quant_method.fp8_input_wanted(layer, x)


@gpu
def test_silu_and_rms_norm_hand_an_fp8_layer_its_input_quantized():
    """LlamaMLP's SiLU quantizes for down_proj, and an RMSNorm (with the residual add) for gate_up_proj: the
    outputs equal the unfused path's bit for bit."""
    from tokenmill.layers.norm import RMSNorm
    from tokenmill.model.llama import LlamaMLP

    if not torch.cuda.is_available():
        pytest.skip("torch._scaled_mm needs a GPU")
    mlp = LlamaMLP(1024, 1536, "silu")
    _make_fp8(mlp.gate_up_proj, seed=0)
    _make_fp8(mlp.down_proj, seed=1)
    mlp.cuda()
    norm = RMSNorm(1024, 1e-5).cuda()
    norm.weight.data = (1 + 0.1 * torch.randn(1024, device="cuda")).to(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    x, r = (torch.randn(40, 1024, generator=g).to(torch.bfloat16).cuda() for _ in range(2))
    h = mlp.gate_up_proj(x)
    assert isinstance(mlp.act_fn(h, consumer=mlp.down_proj), Fp8Activation)
    assert torch.equal(mlp(x), mlp.down_proj(mlp.act_fn(h)))
    quantized, residual = norm(x, r, consumer=mlp.input_projection)
    normed, residual_ref = norm(x, r)
    assert isinstance(quantized, Fp8Activation) and torch.equal(residual, residual_ref)
    assert torch.equal(mlp(quantized), mlp(normed))
