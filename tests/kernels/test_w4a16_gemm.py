"""The integer-weight GEMMs (kernels.w4a16_gemm) against a float64 dequantize-then-matmul reference.

Shapes cover decode (1 row: the GEMV; 7 rows: the GEMV twice; 16 rows: the skinny kernel) and prefill (100 rows: the
dequantization into the shared scratch and a dense GEMM), group sizes
32, 64, 128 and per-channel, symmetric and asymmetric, act-order, 4 and 8 bits, and both ways a step meets
its scales (one per column, or gathered per feature). The cases marked `interpret` run on the CPU under
TRITON_INTERPRET=1 (small shapes); the rest need the GPU.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tokenmill.layers.quant.w4a16 import pack_int32

sys.path.insert(0, os.path.dirname(__file__))
import cases  # noqa: E402

pytestmark = pytest.mark.gpu
interpret = pytest.mark.interpret


def make_weight(n: int, k: int, group: int, bits: int, sym: bool, g: torch.Generator):
    """Random integers packed in the kernels' layout, fp16 scales and zeros (None: symmetric), and the float64
    weight they mean [n, k]."""
    levels = 1 << bits
    q = torch.randint(0, levels, (n, k), generator=g, dtype=torch.int32)
    groups = 1 if group == 0 else k // group
    scale = (torch.rand(n, groups, generator=g) * 0.02 + 0.005).half()
    zero = None if sym else torch.randint(0, levels, (n, groups), generator=g).half()
    size = k // groups
    w = (q.double() - (levels // 2 if zero is None else zero.double().repeat_interleave(size, 1)))
    return pack_int32(q, bits, dim=1), scale, zero, w * scale.double().repeat_interleave(size, 1)


def make_case(rows: int, n: int, k: int, group: int, bits: int, sym: bool, act_order: bool, dtype, device,
              seed: int = 0):
    """Random integers, fp16 scales and zeros in the kernels' layout, and the float64 reference output."""
    g = torch.Generator().manual_seed(seed)
    packed, scale, zero, w = make_weight(n, k, group, bits, sym, g)
    perm = torch.randperm(k, generator=g).to(torch.int32) if act_order else None
    x = torch.randn(rows, k + 8, generator=g).to(dtype)[:, :k]  # a strided view, as real activations can be
    xs = x.double() if perm is None else x.double()[:, perm.long()]
    ref = xs @ w.T
    on = (lambda t: None if t is None else t.to(device))
    return (x.to(device), packed.to(device), scale.to(device), on(zero), on(perm)), ref


def run(fn, rows, n, k, group, bits, sym, act_order, dtype, device, **kw) -> float:
    args, ref = make_case(rows, n, k, group, bits, sym, act_order, dtype, device)
    out = fn(*args, bits, **kw)
    assert out.shape == ref.shape and out.dtype == dtype
    return cases.rel_error(out.cpu(), ref)


DTYPES = [torch.float16, torch.bfloat16]


def skip_bf16_interpreted(device, dtype):
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the interpreter's tl.dot takes bfloat16's bits for integers")


def shape(device) -> tuple[int, int]:
    # n, k not multiples of the tiles (masked edges), k a multiple of 128 (every group size); a quarter
    # under the interpreter.
    return (4096 + 40, 4096) if device == "cuda" else (200, 256)


INTERPRETED = {(7, 128, True, False, 4), (7, 32, False, True, 4), (16, 0, False, False, 4), (1, 64, True, True, 8),
               (100, 128, False, True, 4), (100, 32, True, False, 4), (100, 0, True, False, 8),
               (16, 64, False, True, 4), (1, 0, False, True, 4)}


def params():
    out = []
    for rows in (1, 7, 16, 100):
        for group in (32, 64, 128, 0):
            for sym in (True, False):
                for act_order in (False, True):
                    for bits in (4, 8):
                        key = (rows, group, sym, act_order, bits)
                        marks = [interpret] if key in INTERPRETED else []
                        out.append(pytest.param(*key, marks=marks, id=f"rows{rows}-g{group or 'ch'}-"
                                                f"{'sym' if sym else 'asym'}{'-act' if act_order else ''}-int{bits}"))
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,group,sym,act_order,bits", params())
def test_int_weight_gemm(device, dtype, rows, group, sym, act_order, bits):
    from tokenmill.kernels.w4a16_gemm import int_weight_gemm

    skip_bf16_interpreted(device, dtype)
    n, k = shape(device)
    assert run(int_weight_gemm, rows, n, k, group, bits, sym, act_order, dtype, device) < cases.TOLERANCE[dtype]


@interpret
def test_skinny_tiles_too_large_fall_back_to_the_dequantization(device, monkeypatch):
    """Where the skinny kernel's tiles exceed the device's shared memory (Triton raises before launching), 9-16 rows
    take the dequantization instead, and the shape is remembered so the kernel is not tried again."""
    import triton

    from tokenmill.kernels import w4a16_gemm

    attempts = []

    def too_large(*args, **kwargs):
        attempts.append(args[1].shape)
        raise triton.runtime.errors.OutOfResources(249856, 232448, "shared memory")

    monkeypatch.setattr(w4a16_gemm, "skinny_int_gemm", too_large)
    monkeypatch.setattr(w4a16_gemm, "_SKINNY_DOES_NOT_FIT", set())
    n, k = shape(device)
    for _ in range(2):
        assert run(w4a16_gemm.int_weight_gemm, 12, n, k, 32, 4, False, False, torch.float16, device) < \
            cases.TOLERANCE[torch.float16]
    assert len(attempts) == 1


# The skinny kernel's two ways to meet its scales: 64-wide steps inside group 128 (one scale per column; its default
# is 128), and steps wider than group 32 (the scales gathered per feature).
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,group,config", [
    pytest.param(5, 128, (32, 64, 4, 2), marks=interpret),
    pytest.param(5, 64, (64, 256, 4, 2)),
    pytest.param(12, 32, (32, 64, 4, 2), marks=interpret),
    pytest.param(16, 32, (64, 128, 4, 3)),
])
def test_scale_step_layouts(device, dtype, rows, group, config):
    from tokenmill.kernels.w4a16_gemm import skinny_int_gemm

    skip_bf16_interpreted(device, dtype)
    n, k = shape(device)
    assert run(skinny_int_gemm, rows, n, k, group, 4, False, True, dtype, device, config=config) < \
        cases.TOLERANCE[dtype]


# The GEMV (up to 4 rows) with steps over several groups (group 32 in 128-wide steps), inside one group, and
# per-channel; each row count is its own compiled variant, and each step width and warp count its units of 1, 2
# or 4 words (_gemv_unit: 4 in int4's 1,024-wide steps of one warp and int8's 512-wide, 2 in int4's 512-wide). The
# 512-wide and wider steps over the interpreter's k = 256 take the masked path along k (steps that do not divide k).
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,group,sym,act_order,bits,config", [
    pytest.param(2, 32, False, True, 4, (16, 128, 4, 2), marks=interpret),
    pytest.param(3, 128, True, False, 4, (32, 64, 4, 2), marks=interpret),
    pytest.param(4, 0, False, False, 8, (16, 128, 4, 2), marks=interpret),
    pytest.param(1, 128, False, True, 4, (8, 512, 4, 1), marks=interpret),
    pytest.param(2, 0, True, False, 4, (1, 512, 1, 1), marks=interpret),
    pytest.param(1, 64, False, False, 4, (4, 1024, 1, 1), marks=interpret),
    pytest.param(4, 128, True, True, 4, (4, 1024, 1, 1), marks=interpret),
    pytest.param(2, 64, False, False, 8, (4, 512, 1, 1), marks=interpret),
    pytest.param(1, 128, False, False, 4, (8, 2048, 2, 1)),
    pytest.param(4, 128, True, False, 4, (8, 1024, 2, 1)),
    pytest.param(4, 64, True, True, 4, None),
    pytest.param(3, 32, False, False, 8, None),
    # K split over programs (kernels.split_k): 4 steps in 3 splits (the last one empty), one step a split with
    # act-order int8 steps inside a group; on the GPU the swept shapes' kind of split.
    pytest.param(3, 64, False, False, 4, (4, 64, 1, 1, 3), marks=interpret),
    pytest.param(1, 128, True, True, 8, (8, 64, 2, 1, 4), marks=interpret),
    pytest.param(2, 0, False, False, 4, (2, 64, 1, 1, 2), marks=interpret),
    pytest.param(1, 128, False, False, 4, (4, 1024, 1, 1, 4)),
    pytest.param(4, 32, True, True, 4, (8, 512, 2, 1, 3)),
])
def test_gemv(device, dtype, rows, group, sym, act_order, bits, config):
    from tokenmill.kernels.w4a16_gemm import gemv_int

    skip_bf16_interpreted(device, dtype)
    n, k = shape(device)
    assert run(gemv_int, rows, n, k, group, bits, sym, act_order, dtype, device, config=config) \
        < cases.TOLERANCE[dtype]


# K not a whole number of steps, several steps a program (in one split, and in the second of two or three): the
# ragged last step's words, scales and x masked, the steps before it whole.
@interpret
@pytest.mark.parametrize("rows,config", [(1, (4, 128, 1, 1)), (3, (8, 128, 2, 1, 2)), (2, (4, 64, 1, 1, 3))])
def test_gemv_ragged_last_step(device, rows, config):
    from tokenmill.kernels.w4a16_gemm import gemv_int

    n, k = 72, 448  # group 64: 7 groups; 128-wide steps: 3 whole and half of one
    assert run(gemv_int, rows, n, k, 64, 4, False, True, torch.float16, device, config=config) < \
        cases.TOLERANCE[torch.float16]


@pytest.mark.parametrize("fmt", ["gptq", "awq", "ct"])
def test_layer_apply_on_the_device_matches_the_cpu_path(fmt):
    """Each format's layer, repacked at load, through the kernels (GPU) and through the CPU path: one apply."""
    from tests.e2e.int4_checkpoints import quantized_layer

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if fmt == "ct":
        pytest.importorskip("compressed_tensors")
    layer_cpu, _ = quantized_layer(fmt, n=512, k=1024, group=128, sym=False, act_order=fmt == "gptq", device="cpu")
    layer_gpu, _ = quantized_layer(fmt, n=512, k=1024, group=128, sym=False, act_order=fmt == "gptq", device="cuda")
    for rows in (3, 77):
        x = torch.randn(rows, 1024)
        ref = layer_cpu(x.double().float()).double()
        out = layer_gpu(x.to("cuda", torch.bfloat16))
        assert cases.rel_error(out.cpu(), ref) < cases.TOLERANCE[torch.bfloat16]


# The dequantization alone is exact: (q - zero) * scale is exact in float32 (an 8-bit integer times an fp16 scale),
# so the 16-bit result is the float64 weight rounded once. The interpreter rounds float32 to bfloat16 by
# truncation: bfloat16 runs on the GPU only.
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits,group,sym", [
    pytest.param(4, 32, False, marks=interpret),
    pytest.param(4, 128, True, marks=interpret),
    pytest.param(8, 0, False, marks=interpret),
    pytest.param(8, 64, True),
    pytest.param(4, 0, True),
])
def test_dequantize_int_weight(device, dtype, bits, group, sym):
    from tokenmill.kernels.w4a16_gemm import dequantize_int_weight

    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the interpreter truncates float32 to bfloat16")
    n, k = shape(device)
    packed, scale, zero, w = make_weight(n, k, group, bits, sym, torch.Generator().manual_seed(1))
    out = torch.full((n, k), float("nan"), dtype=dtype, device=device)
    dequantize_int_weight(packed.to(device), scale.to(device), None if zero is None else zero.to(device), bits, out)
    assert torch.equal(out.cpu(), w.to(dtype))


@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, marks=interpret), torch.bfloat16], ids=str)
def test_dequantize_fractional_zero_points(device, dtype):
    """GGUF's Q4_1 / Q4_K zero points are float32 ratios (-m / d), not integers: (q - zero) * scale as float32
    computes it, then rounded once (the GPU served a Q4_1 file wrong while the zero was rounded to an integer)."""
    from tokenmill.kernels.w4a16_gemm import dequantize_int_weight

    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the interpreter truncates float32 to bfloat16")
    g = torch.Generator().manual_seed(2)
    n, k = shape(device)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale = torch.rand(n, k // 32, generator=g) * 0.02 + 0.005
    zero = torch.randn(n, k // 32, generator=g) * 5  # fractional, either sign
    ref = (q.float() - zero.repeat_interleave(32, 1)) * scale.repeat_interleave(32, 1)
    out = torch.full((n, k), float("nan"), dtype=dtype, device=device)
    dequantize_int_weight(pack_int32(q, 4, dim=1).to(device), scale.to(device), zero.to(device), 4, out)
    assert torch.equal(out.cpu(), ref.to(dtype))


# The dequantize-then-GEMM path at any row count (int_weight_gemm takes it past GEMV_MAX_ROWS), act-order
# included; on the GPU also Llama-3.1-8B's qkv, down and o projections at prefill sizes.
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n,k,group,sym,act_order,bits", [
    pytest.param(20, None, None, 128, False, True, 4, marks=interpret),
    pytest.param(33, None, None, 0, True, False, 8, marks=interpret),
    pytest.param(5, None, None, 32, True, True, 4),
    pytest.param(256, 6144, 4096, 128, True, False, 4),
    pytest.param(1000, 4096, 14336, 128, False, True, 4),
    pytest.param(64, 4096, 4096, 64, False, False, 8),
])
def test_dequant_int_gemm(device, dtype, rows, n, k, group, sym, act_order, bits):
    from tokenmill.kernels.w4a16_gemm import dequant_int_gemm

    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the interpreter truncates float32 to bfloat16")
    n, k = (n, k) if n is not None else shape(device)
    assert run(dequant_int_gemm, rows, n, k, group, bits, sym, act_order, dtype, device) < cases.TOLERANCE[dtype]


@interpret
def test_dequant_scratch_is_reserved_once_and_kept(monkeypatch):
    """The first use allocates the largest reservation; smaller asks reuse its memory, a larger one grows it and
    keeps the old buffer (a captured graph may still use it)."""
    from tokenmill.kernels import dequant_scratch as scratch

    monkeypatch.setattr(scratch, "_reserved", {})
    monkeypatch.setattr(scratch, "_buffers", {})
    device = torch.device("cpu")
    scratch.reserve_dequant_scratch(device, 64 * 32)
    scratch.reserve_dequant_scratch(device, 16 * 32)
    first = scratch.dequant_scratch(device, torch.bfloat16, 16, 32)
    assert first.shape == (16, 32) and first.dtype == torch.bfloat16 and first.is_contiguous()
    again = scratch.dequant_scratch(device, torch.float16, 64, 32)
    assert again.shape == (64, 32) and again.data_ptr() == first.data_ptr()
    grown = scratch.dequant_scratch(device, torch.float16, 65, 32)
    assert grown.data_ptr() != first.data_ptr()
    assert [b.numel() for b in scratch._buffers[device]] == [64 * 32, 65 * 32]


def test_dequant_int_gemm_under_a_cuda_graph():
    """Two layers captured in one graph share the scratch; replayed with new inputs they give the eager results."""
    from tokenmill.kernels.dequant_scratch import reserve_dequant_scratch
    from tokenmill.kernels.w4a16_gemm import GEMV_MAX_ROWS, int_weight_gemm

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = torch.Generator().manual_seed(2)
    layers = []
    for n, k in ((3072, 1024), (1024, 3072)):
        packed, scale, zero, _ = make_weight(n, k, 128, 4, False, g)
        layers.append((packed.cuda(), scale.cuda(), zero.cuda(), torch.randperm(k, generator=g).int().cuda(), 4))
        reserve_dequant_scratch(torch.device("cuda", torch.cuda.current_device()), n * k)
    rows = 64
    assert rows > GEMV_MAX_ROWS  # the dequantization's path

    def forward(x):
        return int_weight_gemm(int_weight_gemm(x, *layers[0]), *layers[1])

    static_x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward(static_x)  # compiles, and allocates the scratch, outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = forward(static_x)
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    static_x.copy_(x)
    graph.replay()
    # A stale or shared-too-early scratch would give the other layer's weight: errors of order 1.
    assert cases.rel_error(static_y, forward(x)) < 1e-3


@pytest.mark.parametrize("rows", [1, 7, 16, 100])
@pytest.mark.parametrize("sym", [True, False])
def test_uneven_act_order_groups_padded_to_whole_groups(rows, sym):
    """A row-parallel rank's share of act-order groups (about half of each group of 128, here 1,024 of 2,048 input
    features): the layer pads each group to whole groups of 32 (w4a16.VIRTUAL_GROUP) at the zero point and
    gathers x into that order; through every kernel (the row counts) it matches the float64 product."""
    from tokenmill.kernels.w4a16_gemm import int_weight_gemm
    from tokenmill.layers.quant.w4a16 import IntWeights, _sort_groups

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = torch.Generator().manual_seed(rows)
    n, k_full, k, group, bits = 256, 2048, 1024, 128, 4
    g_idx = torch.empty(k_full, dtype=torch.int32)
    g_idx[torch.randperm(k_full, generator=g)] = (torch.arange(k_full) // group).to(torch.int32)
    g_idx = g_idx[:k]  # this rank's slice: an uneven share of every group
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale = (torch.rand(n, k_full // group, generator=g) * 0.02 + 0.005).half()
    zero = None if sym else torch.randint(0, 16, (n, k_full // group), generator=g).half()
    at = g_idx.long()
    w = (q.double() - (8 if zero is None else zero.double()[:, at])) * scale.double()[:, at]
    sorted_w, perm = _sort_groups(IntWeights(q, scale, zero, g_idx), bits, "test")
    assert perm.shape[0] > k and perm.shape[0] % 32 == 0
    x = torch.randn(rows, k, generator=g, dtype=torch.float16)
    out = int_weight_gemm(x.cuda().index_select(1, perm.cuda()), pack_int32(sorted_w.q, bits, dim=1).cuda(),
                          sorted_w.scale.cuda(), None if sorted_w.zero is None else sorted_w.zero.cuda(), None, bits)
    assert cases.rel_error(out.cpu(), x.double() @ w.T) < cases.TOLERANCE[torch.float16]


def test_split_k_in_a_cuda_graph_gives_the_eager_result_bit_for_bit():
    """Split-K GEMVs (kernels.split_k) replayed from a CUDA graph, twice, and back to back on one arrival buffer:
    each launch leaves its counters at zero for the next, and the partials add in split order, so every replay
    equals the eager call exactly."""
    from tokenmill.kernels.skinny_gemm import skinny_gemm
    from tokenmill.kernels.w4a16_gemm import gemv_int

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    (x, packed, scale, zero, perm), _ = make_case(2, 4096, 4096, 128, 4, False, False, torch.bfloat16, "cuda")
    weight = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 4096**-0.5

    def both():
        return (gemv_int(x, packed, scale, zero, perm, 4, config=(4, 1024, 1, 1, 4)),
                skinny_gemm(x, weight, (32, 256, 4, 3, 3)))

    eager = both()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = both()
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(eager, replayed))
