"""The tensor-core int4 GEMV (kernels.int4_mma_gemv) against a float64 dequantize-then-matmul reference.

Every row count 1-8 (rows past the count read the last one again and must not be stored), fp16 and bf16, symmetric and
asymmetric, group 128 and per-channel, tiles of 1, 2 and 4 column blocks a warp over 1, 2 and 4 warps, K split over
programs (the last to arrive adds the partials), an odd number of groups per program, and CUDA-graph replays (the
arrival counters reset by the launch). The GPU cases need a CUDA device; the compile cases run on the CPU: they
compile the kernel for sm_90 ahead of time, which checks that the operands' layouts need no shared memory (the
conversions are asserted trivial) without running it.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import cases  # noqa: E402
from test_w4a16_gemm import make_weight  # noqa: E402

gpu = pytest.mark.gpu


def make_case(rows, n, k, per_channel, sym, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    packed, scale, zero, w = make_weight(n, k, 0 if per_channel else 128, 4, sym, g)
    x = torch.randn(rows, k + 8, generator=g).to(dtype)[:, :k]  # a strided view, as real activations can be
    return x, packed, scale, zero, x.double() @ w.T


def check(rows, n, k, per_channel, sym, dtype, config, seed=0):
    from tokenmill.kernels.int4_mma_gemv import gemv_int4_mma

    x, packed, scale, zero, ref = make_case(rows, n, k, per_channel, sym, dtype, seed)
    cuda = (lambda t: None if t is None else t.cuda())
    out = gemv_int4_mma(cuda(x), cuda(packed), cuda(scale), cuda(zero), config=config)
    assert out.shape == ref.shape and out.dtype == dtype
    assert cases.rel_error(out.cpu(), ref) < cases.TOLERANCE[dtype]


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_every_row_count(dtype, rows, sym):
    check(rows, 1024, 4096, False, sym, dtype, (4, 1, 2, 2))


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,n,k,per_channel,sym,config", [
    (1, 4096, 4096, False, True, (1, 1, 1, 1)),
    (2, 4096, 4096, False, False, (2, 2, 4, 4)),  # 2 steps of 4 groups a split
    (3, 6144, 4096, True, True, (1, 4, 2, 2)),
    (4, 28672, 4096, False, True, (4, 1, 1, 4)),
    (8, 4096, 14336, False, False, (4, 2, 8, 2)),  # 7 steps a split: the odd one after the pairs
    (5, 4096, 14336, True, False, (2, 1, 7, 1)),  # 16 steps a split: 7 splits of 112 groups
    (1, 512, 640, False, True, (2, 1, 1, 1)),  # 5 steps
    (2, 512, 1536, False, True, (1, 2, 1, 4)),  # 3 steps of 4 groups
    (6, 256, 384, True, True, (1, 1, 3, 1)),  # one group a split
    (7, 48, 1024, False, False, None),  # 3 column blocks: the default tiles of a narrow weight
])
def test_tiles_splits_and_group_counts(dtype, rows, n, k, per_channel, sym, config):
    check(rows, n, k, per_channel, sym, dtype, config)


@gpu
def test_cuda_graph_replays_with_split_k():
    """Two layers sharing the arrival counters, captured once, replayed on new inputs: each replay's outputs equal
    the eager launch's (a counter left non-zero would make the next launch's wrong program finish the sum)."""
    from tokenmill.kernels.int4_mma_gemv import gemv_int4_mma

    layers = [make_case(4, 2048, 4096, False, False, torch.bfloat16, seed)[1:4] for seed in (1, 2)]
    layers = [[t.cuda() if t is not None else None for t in layer] for layer in layers]
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)

    def forward():
        hidden = gemv_int4_mma(x, *layers[0], config=(2, 1, 4, 2))
        return gemv_int4_mma(hidden[:, :2048].repeat(1, 2).contiguous(), *layers[1], config=(1, 2, 8, 1))

    forward()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(out, forward())


@gpu
def test_the_layers_entry_takes_it_where_it_fits(monkeypatch):
    """int_weight_gemm sends up to 8 rows (from the shape's fewest: its table) of group-128 or per-channel int4
    without act-order here, and the rest (act-order, group 64, 9+ rows) to the other kernels; every one against the
    reference."""
    from tokenmill.kernels import w4a16_gemm
    from tokenmill.kernels.int4_mma_gemv import choice

    taken = []
    real = w4a16_gemm.gemv_int4_mma
    monkeypatch.setattr(w4a16_gemm, "gemv_int4_mma", lambda *a, **kw: taken.append(a[0].shape[0]) or real(*a, **kw))
    g = torch.Generator().manual_seed(0)
    fewest = choice(1024, 2048, torch.device("cuda", torch.cuda.current_device()))[1]
    for rows, group, act_order, expected in ((1, 128, False, fewest <= 1), (4, 128, False, fewest <= 4),
                                             (8, 0, False, True), (9, 128, False, False), (2, 64, False, False),
                                             (3, 128, True, False)):
        taken.clear()
        packed, scale, zero, w = make_weight(1024, 2048, group, 4, False, g)
        perm = torch.randperm(2048, generator=g).to(torch.int32) if act_order else None
        x = torch.randn(rows, 2048, generator=g).to(torch.bfloat16)
        ref = (x.double() if perm is None else x.double()[:, perm.long()]) @ w.T
        out = w4a16_gemm.int_weight_gemm(x.cuda(), packed.cuda(), scale.cuda(), zero.cuda(),
                                         None if perm is None else perm.cuda(), 4)
        assert cases.rel_error(out.cpu(), ref) < cases.TOLERANCE[torch.bfloat16]
        assert bool(taken) == expected, (rows, group, act_order)


@pytest.mark.parametrize("dtype,tm,num_warps,rows,splits,kg,per_channel,zero", [
    ("bf16", 4, 1, 1, 1, 4, False, False),
    ("fp16", 2, 2, 8, 4, 2, False, True),
    ("bf16", 1, 4, 3, 2, 1, True, True),
])
def test_compiles_for_hopper_without_shared_memory(dtype, tm, num_warps, rows, splits, kg, per_channel, zero):
    """Ahead of time for sm_90 (no GPU needed): the unpacked words and x are already in the mma's operand layouts
    (the kernel asserts those conversions trivial, so a wrong layout fails to compile), and the only shared memory
    is the split-K arrival's (a few bytes for the atomic's broadcast)."""
    from aot import compile_for_hopper

    from tokenmill.kernels.int4_mma_gemv import _int4_mma_gemv_kernel as kernel

    pointers = {"x_ptr": dtype, "w_ptr": "i32", "s_ptr": "fp16", "z_ptr": "fp16", "out_ptr": dtype,
                "part_ptr": "fp32", "arrivals_ptr": "i32"}
    constants = dict(K=14336, ROWS=rows, TM=tm, SPLITS=splits, KG=kg, GROUPED=not per_channel, HAS_ZERO=zero,
                     PDL=False)
    compiled = compile_for_hopper(kernel, pointers, constants, aligned=("n", "stride_xm", "stride_om"),
                                  num_warps=num_warps)
    assert compiled.metadata.shared <= (16 if splits > 1 else 0)
    assert "mma.sync.aligned.m16n8k16" in compiled.asm["ptx"]


def test_the_background_compile_process_compiles_it(tmp_path, monkeypatch):
    """kernels.compile_worker compiles a recorded Gluon variant from Gluon's own source type (as plain Triton source
    it fails, and the engine's process would compile it at the first launch instead): ahead of time for sm_90."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import serialize_specialization_data

    from tokenmill.kernels.compile_worker import compile_job
    from tokenmill.kernels.int4_mma_gemv import _int4_mma_gemv_kernel as kernel

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compiled here, not found in a cache
    names = kernel.arg_names
    pointers = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16", "out_ptr": "*bf16",
                "part_ptr": "*fp32", "arrivals_ptr": "*i32"}
    constants = dict(K=1024, ROWS=2, TM=2, SPLITS=1, KG=2, GROUPED=True, HAS_ZERO=False)
    signature = {name: pointers.get(name, "constexpr" if name in constants else "i32") for name in names}
    target = GPUTarget("cuda", 90, 32)
    options = make_backend(target).parse_options({"num_warps": 2})
    specialization = serialize_specialization_data(
        kernel.__name__, signature, {(names.index(key),): value for key, value in constants.items()},
        {(names.index(name),): [["tt.divisibility", 16]] for name in pointers}, options, "")
    job = {"module": kernel.__module__, "qualname": "_int4_mma_gemv_kernel", "specialization": specialization,
           "target": [target.backend, target.arch, target.warp_size]}
    compiled, _ = compile_job(job)
    assert compiled
