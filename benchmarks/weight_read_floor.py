"""How fast can a decode step's int4 weights be read at all, against the GEMVs that read them (on a CUDA device).

    PYTHONPATH=. python3 benchmarks/weight_read_floor.py            # TOKENMILL_PDL=0 for the GEMVs without PDL

Llama-3.1-8B's four projections x 32 layers, int4 group 128 (3.6 GB with the scales), distinct weights per layer,
each timed as a CUDA graph of the launches a decode step makes (nothing served from L2):
- one launch reading all of the bytes (the copy-rate ceiling);
- 128 launches of a plain read, one per weight, as the GEMVs launch: with programmatic dependent launch
  (kernels.pdl: each launch lets the next start, and waits before its store) and without;
- the GEMV chains (CUDA-core and tensor-core, kernels.w4a16_gemm / kernels.int4_mma_gemv) at 1 and 4 rows, with
  PDL as the environment sets it.
The gap between the plain reads and the GEMVs is what the GEMVs' own work costs (thirty-third session, H100: one
launch 1.12 ms, 128 reads 1.33, CUDA-core GEMVs 1.74 at one row, tensor-core 2.01).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from skinny_gemm import time_graph
from w4a16_gemm import SHAPES, make_weight

from tokenmill.kernels.int4_mma_gemv import gemv_int4_mma
from tokenmill.kernels.pdl import WITH_PDL, pdl_start
from tokenmill.kernels.w4a16_gemm import gemv_int

LAYERS = 32
BLOCK = 2048  # words a step of a program
CHUNK_MIN_PROGRAMS = 8  # programs per SM at least: each program reads a contiguous chunk


@triton.jit
def _read(w_ptr, out_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    base = tl.program_id(0).to(tl.int64) * CHUNK
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(0, CHUNK, BLOCK):
        acc ^= tl.load(w_ptr + base + i + tl.arange(0, BLOCK))
    pdl_start(PDL)  # signals, then waits before the store (the only write)
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, 0))


def read(words: torch.Tensor, out: torch.Tensor, sms: int, pdl: bool) -> None:
    chunk = BLOCK
    while words.numel() // (2 * chunk) >= CHUNK_MIN_PROGRAMS * sms and words.numel() % (2 * chunk) == 0:
        chunk *= 2
    _read[(words.numel() // chunk,)](words, out, CHUNK=chunk, BLOCK=BLOCK, num_warps=8, **(WITH_PDL if pdl else {}))


def main() -> None:
    torch.manual_seed(0)
    weights = {name: [make_weight(n, k, 4, 128, False, False)[:2] for _ in range(LAYERS)]
               for name, (n, k) in SHAPES.items()}
    total = sum(q.numel() * 4 + s.numel() * 2 for ws in weights.values() for q, s in ws)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
    rate = lambda ms: f"{ms:.3f} ms ({total / ms / 1e9:.2f} TB/s)"
    everything = torch.empty(total // 4 // (BLOCK * 8) * (BLOCK * 8), dtype=torch.int32, device="cuda")
    print(f"{torch.cuda.get_device_name()}: {total / 1e9:.2f} GB of int4 weights and scales", flush=True)
    print("one launch over all of it:", rate(time_graph(lambda: read(everything, out, sms, False), reps=10)))
    for pdl in (False, True):
        ms = time_graph(lambda pdl=pdl: [read(q, out, sms, pdl) for ws in weights.values() for q, _ in ws])
        print(f"{LAYERS * len(SHAPES)} plain reads, {'with' if pdl else 'without'} PDL:", rate(ms), flush=True)
    for rows in (1, 4):
        xs = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _, k in SHAPES.values()}
        chains = {"CUDA-core GEMVs": lambda xs=xs: [gemv_int(xs[q.shape[1] * 8], q, s, None, None, 4)
                                                    for ws in weights.values() for q, s in ws],
                  "tensor-core GEMVs": lambda xs=xs: [gemv_int4_mma(xs[q.shape[1] * 8], q, s, None)
                                                      for ws in weights.values() for q, s in ws]}
        for name, chain in chains.items():
            print(f"{name}, {rows} row(s):", rate(time_graph(chain)), flush=True)


if __name__ == "__main__":
    main()
