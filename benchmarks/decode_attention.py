# ruff: noqa: B023 - the lambdas run inside the iteration that made them
"""Paged decode attention (kernels.decode_attention) on bf16, fp8 (e4m3) and int8 KV pools: how close reading
the cache comes to the copy bandwidth, as the engine calls the kernel, and over its tile constants.

    PYTHONUNBUFFERED=1 python benchmarks/decode_attention.py [--points 16/8x256x1024,...] [--sweep all|w3|none]

A point is query heads / KV heads x batch x context, the context a number or "mixed" (each request's drawn
uniformly from 100-2,048, seeded: W3's spread). The defaults are W3's Qwen3-0.6B heads (16/8, head dim 128) at
batch 64 and 256 and Llama-3.1-8B's (32/8) at two of them; block size 16, blocks scattered over a shuffled pool.
Per point and KV dtype the kernel is checked against a float32 reference on the dequantized pool (max and
relative error; WRONG past 2e-2 relative), then timed as a CUDA graph with L2 flushed before each replay: first
the engine's choice (its split count and tiles), then every (BLOCK_N, num_warps, num_stages) in CONFIGS at the
engine's split count (by default at W3's 16/8 points only: each config compiles once per head group); at the
mixed points also the engine's choice with the requests ordered longest first (the grid's first programs). The
bandwidth is the KV bytes the batch must read (K and V rows of every context token and KV head, plus an int8
pool's float32 row scales) over the time, against a device-to-device copy's. About 2-3 minutes on an H200, most
of it compiling.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fused_moe import bench_graph, copy_bandwidth  # noqa: E402  (benchmarks/fused_moe.py)

from tokenmill.kernels.kv_fp8 import FP8_DTYPE, quantize_kv  # noqa: E402
from tokenmill.kernels.kv_int8 import quantize_rows  # noqa: E402
from tokenmill.kernels.prefill_attention import paged_attention_ref  # noqa: E402

KERNEL_MODULE = "tokenmill.kernels.decode_attention"  # --kernel-module: another (a baseline's copy) to time
HEAD_DIM, BLOCK_SIZE = 128, 16
DEVICE = "cuda"
POINTS = ("16/8x64x512,16/8x64x1024,16/8x64x2048,16/8x64xmixed,16/8x256x512,16/8x256x1024,16/8x256x2048,"
          "16/8x256xmixed,32/8x64x1024,32/8x256xmixed")
KV_DTYPES = ("bf16", "fp8", "int8")
# (BLOCK_N, num_warps, num_stages) that compile for sm_90 without spills for all three dtypes (.dev/aot_decode_attn.py:
# 23-50 warp instructions per key in the loop for the one-byte pools, 25-40 for bf16; one warp: no cross-warp
# reductions in the softmax).
CONFIGS = [(32, 1, 3), (32, 4, 3), (64, 2, 2), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 2)]
CHECKED_REQUESTS = 16


def context_lens(batch: int, context: str) -> torch.Tensor:
    if context == "mixed":
        g = torch.Generator().manual_seed(batch)
        return torch.randint(100, 2049, (batch,), generator=g, dtype=torch.int32)
    return torch.full((batch,), int(context), dtype=torch.int32)


def make_point(heads: int, kv_heads: int, seq_lens: torch.Tensor):
    """(query, bf16 pool, block table, query_start_loc, out) for one decode token per request."""
    batch = len(seq_lens)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    blocks_per_req = triton.cdiv(int(seq_lens.max()), BLOCK_SIZE)
    num_blocks = batch * blocks_per_req
    pool = torch.randn((2, num_blocks, BLOCK_SIZE, kv_heads, HEAD_DIM), generator=g, device=DEVICE)
    block_table = torch.randperm(num_blocks, generator=g, device=DEVICE).to(torch.int32).view(batch, -1)
    query = torch.randn((batch, heads, HEAD_DIM), generator=g, device=DEVICE).to(torch.bfloat16)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    return query, pool, block_table, qsl, torch.empty_like(query)


def quantized(pool: torch.Tensor, kv_dtype: str):
    """(pool in kv_dtype, k_scale, v_scale, bytes per cached token and KV head)."""
    if kv_dtype == "bf16":
        return pool.to(torch.bfloat16), None, None, 2 * HEAD_DIM * 2
    if kv_dtype == "fp8":
        k_scale, v_scale = torch.tensor(4.0 / 448, device=DEVICE), torch.tensor(4.0 / 448, device=DEVICE)
        fp8 = torch.stack([quantize_kv(pool[0], k_scale, FP8_DTYPE), quantize_kv(pool[1], v_scale, FP8_DTYPE)])
        return fp8, k_scale, v_scale, 2 * HEAD_DIM
    (k, k_scale), (v, v_scale) = quantize_rows(pool[0]), quantize_rows(pool[1])
    return torch.stack([k, v]), k_scale, v_scale, 2 * (HEAD_DIM + 4)


def run_point(point: str, copy: float, sweep: bool, totals: dict) -> list[str]:
    """Times one point; its table rows. With sweep, adds each (KV dtype, config)'s time to totals."""
    heads_part, batch, context = point.split("x", 2)
    heads, kv_heads = map(int, heads_part.split("/"))
    seq_lens = context_lens(int(batch), context)
    query, pool, block_table, qsl, out = make_point(heads, kv_heads, seq_lens)
    ids = torch.arange(len(seq_lens), dtype=torch.int32, device=DEVICE)
    scale = HEAD_DIM**-0.5
    kernel = importlib.import_module(KERNEL_MODULE)
    splits = kernel.choose_num_splits(len(seq_lens), kv_heads, query.device)
    check = list(range(0, len(seq_lens), max(1, len(seq_lens) // CHECKED_REQUESTS)))
    print(f"\n{point}: {heads}/{kv_heads} heads, {int(seq_lens.sum())} context tokens, engine's split count {splits}")
    rows = []
    for kv_dtype in KV_DTYPES:
        cache, k_scale, v_scale, token_bytes = quantized(pool, kv_dtype)
        kv_bytes = int(seq_lens.sum()) * kv_heads * token_bytes
        lens = seq_lens.to(DEVICE)
        ref = paged_attention_ref(query[check], cache, list(range(len(check) + 1)), seq_lens[check].tolist(),
                                  block_table[check], scale, dtype=torch.float32, k_scale=k_scale, v_scale=v_scale)

        def measure(label: str, config=None, req_ids=ids) -> float:
            fn = lambda: kernel.decode_attention(query, cache, out, qsl, lens, block_table, req_ids,  # noqa: E731
                                                 scale, config=config, k_scale=k_scale, v_scale=v_scale)
            try:
                out.fill_(float("nan"))
                fn()
                got = out[check].float()
                max_err = (got - ref).abs().max().item()
                rel = ((got - ref).norm() / ref.norm()).item()
                us = bench_graph(fn)
            except Exception as exc:  # out of shared memory or registers for this config: the next one
                print(f"  {kv_dtype:5s} {label:22s} failed: {type(exc).__name__}: {str(exc)[:160]}")
                return math.inf
            tbps = kv_bytes / us / 1e6
            wrong = not rel < 2e-2
            print(f"  {kv_dtype:5s} {label:22s} {us:8.1f} us  {tbps:5.2f} TB/s  {100 * tbps * 1e12 / copy:5.1f}% of "
                  f"copy  max err {max_err:.1e} rel {rel:.1e}{'  WRONG' if wrong else ''}", flush=True)
            return math.inf if wrong else us

        chosen = kernel._config(HEAD_DIM, query.dtype)
        engine = measure(f"engine {chosen}")
        if context == "mixed":  # the programs of the longest requests first: a shorter tail?
            measure("engine, longest first", req_ids=ids[torch.argsort(lens, descending=True)].contiguous())
        best = (engine, chosen)
        for config in CONFIGS if sweep else []:
            us = engine if config == chosen else measure(str(config), config)
            best = min(best, (us, config), key=lambda b: b[0])
            totals[kv_dtype, config] = totals.get((kv_dtype, config), 0.0) + us
        rows.append(f"{point:16s} {kv_dtype:5s} {kv_bytes / 1e6:8.1f} MB  engine {engine:8.1f} us "
                    f"{kv_bytes / engine / 1e6:5.2f} TB/s   best {best[1]} {best[0]:8.1f} us "
                    f"{kv_bytes / best[0] / 1e6:5.2f} TB/s")
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default=POINTS, help="heads/kv_heads x batch x context|mixed, comma separated")
    parser.add_argument("--sweep", choices=("all", "w3", "none"), default="w3",
                        help="where to time CONFIGS beside the engine's choice: every point, W3's (16/8 heads), none")
    parser.add_argument("--kernel-module", default=KERNEL_MODULE,
                        help="the module of decode_attention, choose_num_splits and _config to time (an A/B baseline)")
    args = parser.parse_args()
    globals()["KERNEL_MODULE"] = args.kernel_module
    started = time.perf_counter()
    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {copy / 1e12:.2f} TB/s; bf16 queries, head dim {HEAD_DIM}, "
          f"triton {triton.__version__}; kernel {args.kernel_module}")
    table, totals = [], {}
    for point in args.points.split(","):
        table += run_point(point, copy, args.sweep == "all" or (args.sweep == "w3" and point.startswith("16/8x")),
                           totals)
    print(f"\n{'point':16s} {'kv':5s} {'KV read':>11s}  engine's choice (time, bytes/s)   fastest config\n" +
          "\n".join(table))
    for kv_dtype in KV_DTYPES if totals else []:
        ranked = sorted((us, config) for (dtype, config), us in totals.items() if dtype == kv_dtype)
        print(f"{kv_dtype}: the configs by their time summed over the swept points: " +
              ", ".join(f"{config} {us:.0f} us" for us, config in ranked))
    print(f"{time.perf_counter() - started:.0f} s")
    return 0 if all("inf" not in row for row in table) else 1


if __name__ == "__main__":
    sys.exit(main())
