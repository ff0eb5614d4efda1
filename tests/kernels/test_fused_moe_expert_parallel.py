"""The fused MoE kernel with expert parallelism's masked assignments: ids of -1 (another rank's expert, weight 0)
are left out of the alignment and contribute exactly nothing (skip_negative_ids), on the one-program alignment
(up to 128 assignments) and the chunked one. The reference has no -1 at all: the masked slots go to expert 0
with weight 0 in layers.moe_routing.fused_experts_torch, in float64; the torch path's own -1 handling is
checked against it too.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tokenmill.layers.moe_routing import fused_experts_torch, select_experts

sys.path.insert(0, os.path.dirname(__file__))
import cases  # noqa: E402

pytestmark = pytest.mark.gpu
interpret = pytest.mark.interpret


def masked_case(num_tokens, num_experts, local, top_k, hidden, inter, dtype, device, seed=0):
    """Routing over num_experts; this rank holds experts [local[0], local[1]) (local ids, -1 elsewhere).
    Returns the kernel's inputs on `device` and the float64 reference (on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    first, end = local
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(end - first, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(end - first, hidden, inter, generator=g) * inter**-0.5
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=g), top_k, renormalize=True)
    here = (ids >= first) & (ids < end)
    local_ids, local_weights = torch.where(here, ids - first, -1), torch.where(here, weights, 0.0)
    ref = fused_experts_torch(x.double(), w13.double(), w2.double(), local_weights.double(),
                              local_ids.clamp_min(0))  # masked slots: expert 0 at weight 0
    args = tuple(t.to(device) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), local_weights, local_ids))
    return args, ref


def poison_allocator(num_rows: int, hidden: int, dtype, device) -> None:
    """Leave NaN in the memory the next allocation of this size likely gets (CUDA's caching allocator reuses
    it), so rows the kernel leaves unwritten show."""
    torch.full((num_rows, hidden), float("nan"), dtype=dtype, device=device)


def run_masked(shape, dtype, device, config=None) -> float:
    from tokenmill.kernels.fused_moe import fused_experts

    num_tokens, num_experts, local, top_k, hidden, inter = shape
    args, ref = masked_case(num_tokens, num_experts, local, top_k, hidden, inter, dtype, device)
    assert (args[4] == -1).any() and (args[4] >= 0).any()
    poison_allocator(num_tokens * top_k, hidden, dtype, device)
    out = fused_experts(*args, config=config, skip_negative_ids=True)
    assert out.shape == ref.shape and out.dtype == dtype
    return cases.rel_error(out.cpu(), ref)


# Under the interpreter: small shapes and tiles. (tokens, experts, this rank's [first, end), top_k, H, I)
SMALL = (16, (16, 32, 1, 4, 2), (16, 32, 2, 4, 2))
INTERPRET_SHAPES = {
    "decode": (1, 8, (4, 8), 2, 64, 48),
    "one-chunk": (37, 8, (0, 4), 3, 48, 40),
    "chunks": (60, 6, (2, 5), 3, 32, 32),  # 180 assignments: the three-kernel alignment
    "top1": (9, 4, (1, 3), 1, 32, 32),
}


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(INTERPRET_SHAPES))
def test_masked_assignments_contribute_nothing(device, dtype, name):
    from tokenmill.kernels.fused_moe import MoeConfig

    shape = INTERPRET_SHAPES[name]
    config = None if shape[0] == 1 else MoeConfig(*SMALL)
    assert run_masked(shape, dtype, device, config) < cases.TOLERANCE[dtype]


@interpret
def test_no_local_assignment_at_all_gives_zeros(device):
    """A decode token whose experts are all on other ranks: nothing to align, every GEMM program returns."""
    from tokenmill.kernels.fused_moe import fused_experts

    x = torch.randn(1, 32, device=device)
    w13, w2 = torch.randn(2, 64, 32, device=device), torch.randn(2, 32, 32, device=device)
    ids = torch.full((1, 2), -1, dtype=torch.int64, device=device)
    weights = torch.zeros(1, 2, device=device)
    poison_allocator(2, 32, torch.float32, device)
    assert torch.equal(fused_experts(x, w13, w2, weights, ids, skip_negative_ids=True), torch.zeros_like(x))
    assert torch.equal(fused_experts_torch(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu()),
                       torch.zeros_like(x.cpu()))


@interpret
@pytest.mark.parametrize("num_tokens,top_k", [(20, 4), (70, 3)], ids=["one-chunk", "chunks"])
def test_alignment_leaves_masked_assignments_out(device, num_tokens, top_k):
    from tokenmill.kernels.fused_moe import align_assignments

    num_experts, block_m = 5, 16
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(-1, num_experts, (num_tokens, top_k), generator=g)
    align = align_assignments(ids.to(device), num_experts, block_m)
    flat = ids.reshape(-1)
    counts = torch.bincount(flat[flat >= 0], minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    assert int(align.num_padded) == int(padded.sum()) <= align.max_padded
    sorted_ids = align.sorted_ids.cpu()
    for expert in range(num_experts):
        run = sorted_ids[starts[expert] : starts[expert] + padded[expert]]
        assert torch.equal(run[: counts[expert]], (flat == expert).nonzero().flatten().to(torch.int32))
        assert (run[counts[expert] :] == flat.numel()).all()


def test_torch_path_skips_masked_assignments():
    """The CPU path: the -1 slots filtered on the host, the same result as expert 0 at weight 0."""
    args, ref = masked_case(50, 8, (2, 6), 3, 32, 24, torch.float64, "cpu")
    torch.testing.assert_close(fused_experts_torch(*args), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 16, 512])
def test_masked_assignments_gpu_shapes(device, dtype, num_tokens):
    """Qwen3-30B-A3B's experts over two ranks: 64 of 128 experts here, top-8 (half the assignments elsewhere)."""
    if device == "cpu":
        pytest.skip("GPU shapes")
    shape = (num_tokens, 128, (64, 128), 8, 2048, 768)
    assert run_masked(shape, dtype, device) < cases.TOLERANCE[dtype]
