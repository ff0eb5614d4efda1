"""Programmatic dependent launch (kernels.pdl): the decode path's kernels wait for the kernel before them.

On the CPU (CI), compiled ahead of time for sm_90: every PDL kernel waits before its first load of data another
kernel writes and before any store, the GEMVs load their first weights before the wait, and without PDL nothing
changes. On a Hopper GPU: a decode layer's chain of kernels replayed in a CUDA graph gives the same outputs, bit for
bit, with PDL as without it (a kernel reading before the one before it finished would read stale activations).
"""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from aot import compile_for_hopper  # noqa: E402
from test_w4a16_gemm import make_weight  # noqa: E402

triton = pytest.importorskip("triton")


def ptx_of(kernel, pointers: dict[str, str], constants: dict, floats: tuple[str, ...] = (), num_warps: int = 4,
           aligned: tuple[str, ...] = ()) -> str:
    return compile_for_hopper(kernel, pointers, constants, floats, aligned, num_warps).asm["ptx"]


def order(ptx: str) -> list[str]:
    """The kernel's global loads, stores, atomics and grid-dependency instructions in program order."""
    return re.findall(r"griddepcontrol\.\w+|ld\.global|st\.global|atom\.global|cp\.async\.c[ag]", ptx)


GEMV_POINTERS = {"x_ptr": "bf16", "w_ptr": "i32", "s_ptr": "fp16", "z_ptr": "fp16", "perm_ptr": "i32",
                 "out_ptr": "bf16", "part_ptr": "fp32", "arrivals_ptr": "i32"}


def cuda_core_gemv_ptx(pdl: bool, splits: int) -> str:
    from tokenmill.kernels.w4a16_gemm import _gemv_int_kernel

    return ptx_of(_gemv_int_kernel, GEMV_POINTERS, dict(
        BITS=4, GROUP=128, HAS_ZERO=False, HAS_PERM=False, ROWS=1, BLOCK_N=8, BLOCK_K=2048, EVEN_K=True, H=4,
        SPLITS=splits, PDL=pdl), num_warps=2,
        # As a launch on Llama-8B's shapes specialises them (divisible by 16): 16-byte weight loads, as in the engine.
        aligned=("n", "k", "k_per_split", "stride_xm", "stride_wn", "stride_sn", "stride_om"))


def mma_gemv_ptx(pdl: bool) -> str:
    from tokenmill.kernels.int4_mma_gemv import _int4_mma_gemv_kernel

    pointers = {name: GEMV_POINTERS[name] for name in ("x_ptr", "w_ptr", "s_ptr", "z_ptr", "out_ptr", "part_ptr",
                                                          "arrivals_ptr")}
    return ptx_of(_int4_mma_gemv_kernel, pointers, dict(K=4096, ROWS=4, TM=1, SPLITS=8, KG=2, GROUPED=True,
                                                         HAS_ZERO=False, PDL=pdl))


@pytest.mark.parametrize("gemv", ["cuda-core", "cuda-core split-K", "tensor-core"])
def test_the_gemvs_load_weights_then_wait_before_anything_else(gemv):
    ptx = {"cuda-core": lambda pdl: cuda_core_gemv_ptx(pdl, 1),
           "cuda-core split-K": lambda pdl: cuda_core_gemv_ptx(pdl, 4),
           "tensor-core": mma_gemv_ptx}[gemv]
    steps = order(ptx(True))
    assert steps[0] == "griddepcontrol.launch_dependents"
    wait = steps.index("griddepcontrol.wait")
    assert wait > 1 and set(steps[1:wait]) == {"ld.global"}  # the first step's words and scales: read-only
    assert "griddepcontrol.wait" not in steps[wait + 1:]
    without = order(ptx(False))
    assert not any(step.startswith("griddepcontrol") for step in without)
    assert len(without) == len(steps) - 2  # the same loads and stores, in the same order


def test_the_other_decode_kernels_wait_first():
    from tokenmill.kernels.activation import _silu_and_mul_kernel
    from tokenmill.kernels.rms_norm import _rms_norm_kernel

    cases = [
        (_rms_norm_kernel, {n: "bf16" for n in ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "residual_out_ptr")}
         | {"scale_ptr": "fp32"}, dict(HAS_RESIDUAL=True, HAS_OFFSET=False, BLOCK=4096, QUANTIZE_FP8=False),
         ("eps", "offset")),
        (_silu_and_mul_kernel, {"x_ptr": "bf16", "out_ptr": "bf16", "scale_ptr": "fp32"},
         dict(BLOCK=1024, QUANTIZE_FP8=False), ()),
    ]
    for kernel, pointers, constants, floats in cases:
        steps = order(ptx_of(kernel, pointers, constants | {"PDL": True}, floats))
        assert steps[:2] == ["griddepcontrol.launch_dependents", "griddepcontrol.wait"], kernel
        assert "griddepcontrol.wait" not in steps[2:]
        without = order(ptx_of(kernel, pointers, constants | {"PDL": False}, floats))
        assert not any(step.startswith("griddepcontrol") for step in without)


def test_the_skinny_gemm_waits_first_and_lets_the_next_launch_after_its_k_loop():
    """The bf16 skinny GEMM: the wait before any load (its x is the kernel before's output), the next launch let in
    only after every load of its K loop (kernels.pdl: earlier, waiting programs cost W1 15%), then the stores."""
    from tokenmill.kernels.skinny_gemm import _skinny_gemm_kernel

    pointers = {"x_ptr": "bf16", "w_ptr": "bf16", "out_ptr": "bf16", "part_ptr": "fp32", "arrivals_ptr": "i32"}

    def skinny_steps(pdl: bool, splits: int) -> list[str]:
        constants = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SPLITS=splits, PDL=pdl)
        return order(ptx_of(_skinny_gemm_kernel, pointers, constants, num_warps=4,
                            aligned=("n", "k", "k_per_split", "stride_xm", "stride_wn", "stride_om")))

    for splits in (1, 4):
        steps = skinny_steps(True, splits)
        assert steps[0] == "griddepcontrol.wait" and steps.count("griddepcontrol.wait") == 1
        signal = steps.index("griddepcontrol.launch_dependents")
        loads = [i for i, step in enumerate(steps) if step in ("ld.global", "cp.async.ca", "cp.async.cg")]
        stores = [i for i, step in enumerate(steps) if step in ("st.global", "atom.global")]
        first_write = min(stores)  # (split-K: the partials' reads come after it, once a tile's splits are in)
        assert max(i for i in loads if i < first_write) < signal < first_write, (splits, steps)
        without = skinny_steps(False, splits)
        assert not any(step.startswith("griddepcontrol") for step in without)
        assert len(without) == len(steps) - 2  # the same loads and stores, in the same order


def test_off_the_gpu_launches_add_nothing():
    from tokenmill.kernels.pdl import pdl_launch

    assert pdl_launch(torch.device("cpu")) == {}


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="programmatic dependent launch needs sm_90+")
@pytest.mark.parametrize("rows", [1, 4])
def test_a_decode_layer_in_a_cuda_graph_gives_the_same_outputs_with_and_without_pdl(monkeypatch, rows):
    """Norm, int4 GEMV, SiLU-and-mul, int4 GEMV, norm and a bf16 skinny GEMM, eight layers, replayed on new
    inputs: with PDL the outputs equal those without, bit for bit (the kernels are deterministic)."""
    from tokenmill.kernels import pdl
    from tokenmill.kernels.activation import silu_and_mul
    from tokenmill.kernels.rms_norm import rms_norm
    from tokenmill.kernels.skinny_gemm import skinny_gemm
    from tokenmill.kernels.w4a16_gemm import int_weight_gemm

    g = torch.Generator().manual_seed(0)
    hidden, inter = 4096, 4096
    layers = []
    for _ in range(8):
        gate_up, scale_gu, _, _ = make_weight(2 * inter, hidden, 128, 4, True, g)
        down, scale_d, _, _ = make_weight(hidden, inter, 128, 4, True, g)
        dense = (torch.randn(hidden, hidden, generator=g) / hidden**0.5).to(torch.bfloat16)
        layers.append([t.cuda() for t in (gate_up, scale_gu, down, scale_d, dense)])
    norm_weight = torch.rand(hidden, generator=g).to(torch.bfloat16).cuda() + 0.5
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)

    def forward():
        h, residual = x, torch.zeros_like(x)
        for gate_up, scale_gu, down, scale_d, dense in layers:
            normed, residual = rms_norm(h, norm_weight, 1e-5, residual=residual)
            up = int_weight_gemm(normed, gate_up, scale_gu, None, None, 4)
            h = int_weight_gemm(silu_and_mul(up), down, scale_d, None, None, 4)
            normed, residual = rms_norm(h, norm_weight, 1e-5, residual=residual)
            h = skinny_gemm(normed, dense)
        return h

    def replays(enabled: bool) -> list[torch.Tensor]:
        monkeypatch.setenv("TOKENMILL_PDL", "1" if enabled else "0")
        pdl._pdl_on.cache_clear()
        assert bool(pdl.pdl_launch(x.device)) == enabled
        torch.manual_seed(1)
        x.copy_(torch.randn_like(x))
        forward()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = forward()
        outputs = []
        for _ in range(20):
            x.copy_(torch.randn_like(x))
            graph.replay()
            outputs.append(out.clone())
        return outputs

    try:
        with_pdl, without = replays(True), replays(False)
    finally:
        pdl._pdl_on.cache_clear()
    assert all(torch.isfinite(out).all() for out in without)
    for a, b in zip(with_pdl, without):
        assert torch.equal(a, b)
