"""MLA decode attention (kernels.mla_decode) at DeepSeek-V2-Lite's shape: how close reading the latent cache
comes to the copy bandwidth.

    python benchmarks/mla_decode.py [--heads 16] [--batch 64] [--context 4096] [--no-sweep]

Batch 64 x 4k-token contexts, 16 heads (V2-Lite; --heads 128 for V3 on one GPU), kv_lora_rank 512 + rope 64,
bfloat16, block size 16, blocks scattered over a shuffled pool. First the default tiles and split choice are
checked against the float64 reference; then each is timed as a CUDA graph (as the decode path runs), L2
flushed before each replay, and its bandwidth is the bytes it must read (every request's latent rows, the
queries) and write (the outputs) over its time, against a device-to-device copy's (read + write) bandwidth
measured here. The issue's target: >= 80% of the copy. A sweep of tiles and split counts follows (a faster
one can replace kernels.mla_decode.decode_config's choice; tests/kernels/test_mla_attention.py checks those
tiles). Takes well under 2 minutes, most of it compiling the sweep's variants.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fused_moe import bench_graph  # noqa: E402  (benchmarks/fused_moe.py: CUDA-graph replay, L2 flushed)

from tokenmill.kernels.mla_decode import (  # noqa: E402
    choose_num_splits,
    decode_config,
    mla_attention_ref,
    mla_decode_attention,
)

LATENT, ROPE, BLOCK_SIZE = 512, 64, 16


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy of 2 GiB (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    seconds = do_bench(lambda: dst.copy_(src), warmup=5, rep=50) / 1e3
    return 2 * src.numel() * src.element_size() / seconds


def make_inputs(batch: int, context: int, heads: int, dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_req = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_req
    cache = torch.randn((num_blocks, BLOCK_SIZE, LATENT + ROPE), generator=g, device="cuda").to(dtype)
    block_table = torch.randperm(num_blocks, generator=g, device="cuda").to(torch.int32).view(batch, -1)
    query = torch.randn((batch, heads, LATENT + ROPE), generator=g, device="cuda").to(dtype)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    out = torch.empty((batch, heads, LATENT), dtype=dtype, device="cuda")
    return query, cache, block_table, qsl, seq_lens, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    dtype = torch.bfloat16
    scale = 192**-0.5
    query, cache, block_table, qsl, seq_lens, out = make_inputs(args.batch, args.context, args.heads, dtype)
    ids = torch.arange(args.batch, dtype=torch.int32, device="cuda")
    element = cache.element_size()
    moved = (args.batch * args.context * (LATENT + ROPE) + query.numel() + out.numel()) * element
    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {copy / 1e12:.2f} TB/s; batch {args.batch} x {args.context} "
          f"tokens, {args.heads} heads, {dtype}: {moved / 1e6:.1f} MB per call")

    def run(config=None, num_splits=None):
        return lambda: mla_decode_attention(query, cache, out, qsl, seq_lens, block_table, ids, scale,
                                            num_splits=num_splits, config=config)

    default = decode_config(args.heads, dtype)
    splits = choose_num_splits(args.batch, math.ceil(args.heads / default[0]), query.device)
    run(default)()
    check = list(range(0, args.batch, max(1, args.batch // 4)))
    ref = mla_attention_ref(query[check], cache, list(range(len(check) + 1)), [args.context] * len(check),
                            block_table[check], scale, LATENT)
    error = ((out[check].double() - ref).norm() / ref.norm()).item()
    print(f"default tiles {default}, {splits} splits: relative error {error:.2e} against float64")
    if not error < 2e-2:
        print("FAIL: the default decode kernel is wrong")
        return 1

    def report(label, fn) -> float:
        try:
            us = bench_graph(fn)
        except OutOfResources as exc:
            print(f"  {label:34s} out of resources ({exc})")
            return math.inf
        gbps = moved / us / 1e3
        print(f"  {label:34s} {us:8.1f} us  {gbps:7.0f} GB/s  {100 * gbps * 1e9 / copy:5.1f}% of copy")
        return us

    best = report(f"default {default} splits={splits}", run(default))
    if not args.no_sweep:
        block_hs = [16] if args.heads <= 16 else [16, 32, 64]
        for block_h in block_hs:
            for block_n in (16, 32, 64):
                for warps, stages in ((4, 2), (4, 3), (8, 2), (4, 4)):
                    config = (block_h, block_n, warps, stages)
                    for num_splits in (1, 2, 4, 8):
                        best = min(best, report(f"{config} splits={num_splits}", run(config, num_splits)))
    print(f"best {moved / best / 1e3:.0f} GB/s = {100 * moved / best / copy * 1e6:.1f}% of copy "
          f"(target >= 80%); {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
