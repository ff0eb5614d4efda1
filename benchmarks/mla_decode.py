"""MLA decode attention (kernels.mla_decode): how close reading the latent cache comes to the copy bandwidth, and
the tiles and split counts that get closest, written as the kernel's table.

    PYTHONUNBUFFERED=1 python benchmarks/mla_decode.py [--out DIR] [--points 16x64x4096,128x32x4096]

Each point is heads x batch x context: by default DeepSeek-V2-Lite's 16 heads at batch 64 x 4k (the issue's
point, target >= 80% of the copy), batch 1 x 4k and batch 256 x 1k, and V3's 128 heads (one GPU) at batch
32 x 4k; kv_lora_rank 512 + rope 64, bfloat16, block size 16, blocks scattered over a shuffled pool. Every
candidate (tiles x split count) is timed as a CUDA graph (as the decode path runs), L2 flushed before each
replay, and its output checked against a float32 reference (WRONG past 2e-2); its bandwidth is the latent
rows it must read (batch x context x 576 x 2 bytes) over its time, against a device-to-device copy's (read +
write) measured here. The kernel's own choice (the table when there is one) is timed first. With --out, the
fastest correct config of each point is written to DIR/mla_decode_<device>.json: copy it into
tokenmill/kernels/configs/ for the kernel to read (the split count is kept as programs per SM, so the batch
sizes between the points get whole waves too). About 3 minutes on an H200, most of it compiling.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fused_moe import bench_graph, copy_bandwidth, dump_configs  # noqa: E402  (benchmarks/fused_moe.py)

from tokenmill.kernels.mla_decode import (  # noqa: E402
    MAX_SPLITS,
    DecodeConfig,
    _num_sms,
    choose_num_splits,
    decode_config,
    decode_config_path,
    decode_shape_key,
    mla_attention_ref,
    mla_decode_attention,
)

LATENT, ROPE, BLOCK_SIZE = 512, 64, 16
DTYPE = torch.bfloat16
DEVICE = "cuda"
POINTS = "16x64x4096,16x1x4096,16x256x1024,128x32x4096"
# (BLOCK_H, BLOCK_N, num_warps, num_stages) that compile for sm_90 without spills (AOT-compiled: registers
# a thread and shared memory, so programs per SM). 16 heads, one head tile: two programs per SM for
# (16, 16, 4, 6), (16, 32, 4, 3), (16, 32, 8, 3) (split), one for the others.
TILES_16 = [(16, 16, 4, 6), (16, 32, 4, 3), (16, 32, 4, 4), (16, 32, 8, 3), (16, 32, 8, 4), (16, 64, 8, 3)]
# 128 heads: tiles of 16, 32 (mma.sync) or 64 heads (64 rows: wgmma, 24 spilling instructions), the head
# tiles of a request reading the same pages; one program per SM.
TILES_128 = [(16, 32, 8, 3), (16, 64, 8, 3), (32, 32, 8, 3), (32, 32, 8, 4), (64, 32, 8, 2), (64, 32, 8, 3)]
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)


def make_inputs(batch: int, context: int, heads: int):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    blocks_per_req = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_req
    cache = torch.randn((num_blocks, BLOCK_SIZE, LATENT + ROPE), generator=g, device=DEVICE).to(DTYPE)
    block_table = torch.randperm(num_blocks, generator=g, device=DEVICE).to(torch.int32).view(batch, -1)
    query = torch.randn((batch, heads, LATENT + ROPE), generator=g, device=DEVICE).to(DTYPE)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    out = torch.empty((batch, heads, LATENT), dtype=DTYPE, device=DEVICE)
    return query, cache, block_table, qsl, seq_lens, out


def split_candidates(batch: int, head_blocks: int, sms: int) -> list[int]:
    """The split counts whose grid has from half a program to 4 programs per SM; at batch 1 the largest six."""
    fit = [s for s in SPLITS if s <= MAX_SPLITS and batch * head_blocks * s <= 4 * sms]
    busy = [s for s in fit if 2 * batch * head_blocks * s >= sms]
    return busy or (fit or [1])[-6:]


def run_point(heads: int, batch: int, context: int, copy: float, sms: int):
    """Times the kernel's choice and every candidate; (best (us, tiles, splits), the choice's us) or None."""
    query, cache, block_table, qsl, seq_lens, out = make_inputs(batch, context, heads)
    ids = torch.arange(batch, dtype=torch.int32, device=DEVICE)
    scale = 192**-0.5
    latent_bytes = batch * context * (LATENT + ROPE) * cache.element_size()
    check = list(range(0, batch, max(1, batch // 4)))
    ref = mla_attention_ref(query[check], cache, list(range(len(check) + 1)), [context] * len(check),
                            block_table[check], scale, LATENT, dtype=torch.float32)
    print(f"\n{heads} heads, batch {batch} x {context} tokens: {latent_bytes / 1e6:.1f} MB of latent rows")

    def measure(label: str, config=None, num_splits=None) -> float:
        fn = lambda: mla_decode_attention(query, cache, out, qsl, seq_lens, block_table, ids, scale,  # noqa: E731
                                          num_splits=num_splits, config=config)
        try:
            us = bench_graph(fn)
        except Exception as exc:  # out of shared memory for this chip, or a compile failure: the next one
            print(f"  {label:36s} failed: {type(exc).__name__}: {str(exc)[:160]}")
            return math.inf
        error = ((out[check].float() - ref).norm() / ref.norm()).item()
        tbps = latent_bytes / us / 1e6
        wrong = not error < 2e-2
        print(f"  {label:36s} {us:8.1f} us  {tbps:5.2f} TB/s  {100 * tbps * 1e12 / copy:5.1f}% of copy  "
              f"err {error:.1e}{'  WRONG' if wrong else ''}", flush=True)
        return math.inf if wrong else us

    choice = decode_config(heads, DTYPE, cache.dtype, batch, query.device)
    chosen_splits = choose_num_splits(batch, triton.cdiv(heads, choice.tiles[0]), query.device,
                                      choice.programs_per_sm)
    chosen = measure(f"kernel's choice {choice.tiles} s={chosen_splits}")
    best = (math.inf, None, None)
    for tiles in TILES_16 if heads <= 16 else TILES_128:
        for splits in split_candidates(batch, triton.cdiv(heads, tiles[0]), sms):
            best = min(best, (measure(f"{tiles} s={splits}", tiles, splits), tiles, splits), key=lambda b: b[0])
    return (best if best[1] else None), chosen, latent_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default=POINTS, help="heads x batch x context, comma separated")
    parser.add_argument("--out", type=Path, help="write the best configs to DIR/mla_decode_<device>.json")
    args = parser.parse_args()
    started = time.perf_counter()
    device_name = torch.cuda.get_device_name()
    sms = _num_sms(torch.cuda.current_device())
    copy = copy_bandwidth()
    print(f"{device_name}, {sms} SMs: copy {copy / 1e12:.2f} TB/s; {DTYPE}, triton {triton.__version__}")
    saved = {"configs": {}}
    if args.out:
        path = decode_config_path(device_name, args.out)
        saved = json.loads(path.read_text()) if path.exists() else saved
        saved.update(device=device_name, triton=triton.__version__)
    summary = []
    for point in args.points.split(","):
        heads, batch, context = map(int, point.split("x"))
        best, chosen, latent_bytes = run_point(heads, batch, context, copy, sms)
        torch.cuda.empty_cache()  # the point's cache
        if best is None:
            summary.append(f"{point:14s} no candidate ran correctly")
            continue
        us, tiles, splits = best
        percent = [100 * latent_bytes / t / 1e-6 / copy for t in (us, chosen)]
        summary.append(f"{point:14s} best {tiles} s={splits}: {us:.1f} us, {percent[0]:.1f}% of copy; "
                       f"kernel's choice {chosen:.1f} us, {percent[1]:.1f}%")
        # Rounded up (the kernel rounds the split count down); at the split cap the point only says "more".
        programs_per_sm = math.ceil(batch * triton.cdiv(heads, tiles[0]) * splits / sms * 1e4) / 1e4
        if splits == MAX_SPLITS:
            programs_per_sm = max(programs_per_sm, 1.0)
        key = decode_shape_key(heads, DTYPE, DTYPE)
        saved["configs"].setdefault(key, {})[str(batch)] = DecodeConfig(tiles, programs_per_sm).to_json()
    print(f"\nsummary (% of the copy's {copy / 1e12:.2f} TB/s on the latent rows; the issue's target >= 80% at "
          f"16x64x4096):")
    print("\n".join(summary))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(dump_configs(saved))
        print(f"wrote {path} (copy it into tokenmill/kernels/configs/ for the kernel to read)")
    print(f"{time.perf_counter() - started:.0f} s")
    return 0 if len(summary) and all("no candidate" not in line for line in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
