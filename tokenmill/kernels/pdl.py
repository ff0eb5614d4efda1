"""Programmatic dependent launch (PDL, Hopper and later): the decode path's kernels overlap each other's launch.

A batch-1 decode step is ~290 short kernels (a layer: norm, qkv GEMV, rotary + KV write, attention, o GEMV, norm,
gate_up GEMV, SiLU-and-mul, down GEMV), each a few microseconds, and each paid its launch and the latency of its
first loads after the one before it had finished. Launched with PDL, a kernel may start while the kernel before it
in the stream still runs: it must wait (`griddepcontrol.wait`, which returns once that kernel has completed and its
writes are visible) before it reads anything an earlier kernel writes or writes anything one reads. So each kernel
of the chain:
- lets the next kernel launch as soon as it starts (`launch_dependents`; the skinny GEMM only after its K loop),
- loads what no kernel writes (the int4 GEMVs: their first step of weights) and then waits,
- and waits in every program before anything else: a PDL-launched kernel that did not wait could complete before
  the one before it, and a later kernel launched without PDL would then overtake that one.
The kernels: RMSNorm, rotary + KV write, decode attention, SiLU-and-mul, the int4 GEMVs (CUDA-core and
tensor-core) and the bf16 skinny GEMM. Measured on an H100 (BENCHMARKS.md, thirty-third session): W1 on int4 weights
1,458 -> 1,306 ms at batch 1 (1.12x), 1,884 -> 1,850 at batch 4. The skinny GEMM lets the next kernel launch only
after its K loop: letting it in at the start made W1 15% slower (2,959 -> 3,399 ms; its pipelined tiles hold up to
~120 KB of shared memory a program, which programs launched early and waiting may keep from the SMs); after the loop,
W1 3,061-3,071 -> 2,983-3,004 ms (2.3% faster; one H100, six runs alternated over two calls, thirty-sixth session).
Kernels launched without PDL (torch's, cuBLAS's) keep the plain stream order, before and after.

TOKENMILL_PDL=0 turns it off (for A/B measurements); off the GPU, on ROCm and below sm_90 it is off.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys

try:  # triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - the engine pins a triton that has them
    gdc_launch_dependents = gdc_wait = None


@functools.cache
def _pdl_on(device: torch.device) -> bool:
    return (gdc_wait is not None and device.type == "cuda" and torch.version.hip is None  # NVIDIA's PTX only
            and os.environ.get("TOKENMILL_PDL", "1") != "0" and torch.cuda.get_device_capability(device) >= (9, 0))


WITH_PDL = {"PDL": True, "launch_pdl": True}
"""A launch's keyword arguments for a kernel with a PDL constexpr, launched with PDL."""


def pdl_launch(device: torch.device) -> dict:
    """A launch's extra keyword arguments: WITH_PDL where PDL is on, else none (the kernels' PDL defaults to False:
    the same specialisation, and cache key, as without it)."""
    return WITH_PDL if _pdl_on(device) else {}


@triton.jit
def let_next_launch(PDL: tl.constexpr):
    """Lets the kernel after this one launch (it waits for this one's completion before touching data)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Waits until the kernel before this one has completed, its writes visible; every PDL kernel calls it."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """A kernel's first lines when nothing it loads can come before the wait: let the next launch, then wait."""
    let_next_launch(PDL)
    wait_for_previous(PDL)


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
