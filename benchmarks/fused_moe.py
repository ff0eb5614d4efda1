"""Check and tune kernels.fused_moe on the GPU: correctness against fused_experts_torch, a sweep of tiles per
token bucket, and the tuned configs written to DIR/fused_moe_<device>.json (the file the kernel reads from
tokenmill/kernels/configs/).

    python benchmarks/fused_moe.py --out DIR [--shapes qwen3-30b-a3b,mixtral] [--buckets 1,16,256]

Shapes: Qwen3-30B-A3B's experts (E=128, K=8, H=2048, I=768), its TP=2 slice (I=384), Mixtral-8x7B's (E=8,
K=2, H=4096, I=14336), in bfloat16 (float16 shares the tiles). For each bucket of tokens, the gate/up and
the down GEMM are timed separately for each candidate tiling of each candidate BLOCK_M (the two GEMMs are
independent launches), the best pair per BLOCK_M plus its alignment wins. Then the whole fused_experts runs
with the winner and is checked against the float32 torch path; the table gives its time, the time of the
bf16 torch path (a loop over experts), and the floor: the bytes of the experts actually touched (plus the
activations in and out) at the copy bandwidth measured here.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenmill.kernels.fused_moe import (  # noqa: E402
    CONFIG_DIR,
    MoeConfig,
    align_assignments,
    config_path,
    down_gemm,
    fused_experts,
    gate_up_gemm,
    shape_key,
)
from tokenmill.layers.moe_routing import fused_experts_torch, select_experts  # noqa: E402

SHAPES = {  # name: (experts, top_k, hidden, intermediate)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "qwen3-30b-a3b-tp2": (128, 8, 2048, 384),
    "mixtral": (8, 2, 4096, 14336),
}
BUCKETS = (1, 4, 16, 64, 256, 1024, 4096)
DTYPE = torch.bfloat16
DEVICE = "cuda"

# Candidate tiles per BLOCK_M: (BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages). Those that do not fit the
# shared memory fail at launch and are skipped.
GATE_UP_TILES = {
    16: [(16, 256, 1, 4, 4), (32, 128, 1, 4, 4), (32, 128, 1, 4, 6), (32, 256, 1, 4, 4), (64, 128, 1, 4, 4),
         (64, 256, 1, 4, 3)],
    32: [(32, 128, 4, 4, 4), (64, 64, 4, 4, 4), (64, 128, 4, 4, 3)],
    64: [(64, 64, 8, 4, 3), (64, 64, 8, 4, 4), (64, 128, 8, 4, 3), (128, 64, 8, 8, 3)],
    128: [(64, 64, 8, 8, 3), (64, 64, 8, 4, 4), (128, 64, 8, 8, 3)],
}
DOWN_TILES = {
    16: [(32, 128, 1, 4, 4), (32, 256, 1, 4, 4), (64, 128, 1, 4, 4), (64, 256, 1, 4, 3), (128, 128, 1, 4, 3)],
    32: [(64, 64, 4, 4, 4), (64, 128, 4, 4, 3), (128, 64, 4, 4, 4)],
    64: [(64, 64, 8, 4, 3), (128, 64, 8, 4, 3), (128, 64, 8, 8, 4), (128, 128, 8, 8, 3)],
    128: [(64, 64, 8, 4, 4), (128, 64, 8, 8, 3), (128, 128, 8, 8, 3), (256, 64, 8, 8, 3)],
}


def block_m_candidates(rows_per_expert: float) -> list[int]:
    if rows_per_expert <= 8:
        return [16]
    if rows_per_expert <= 32:
        return [16, 32, 64]
    if rows_per_expert <= 128:
        return [32, 64, 128]
    return [64, 128]


def bench(fn) -> float:
    """Microseconds, L2 flushed between runs (a layer's experts are not in L2 when it runs)."""
    return do_bench(fn, warmup=5, rep=25) * 1e3


def bench_graph(fn, iters: int = 50) -> float:
    """Microseconds of fn replayed as a CUDA graph (as the decode path runs it: no launch overhead), L2
    flushed before each replay. Capturing it also shows that fn reads nothing back on the host."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        flush.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return sorted(start.elapsed_time(end) for start, end in events)[iters // 2] * 1e3


def best_tiles(fn, candidates) -> tuple[float, tuple | None]:
    """(us, tiles) of the fastest of fn(tiles) over the candidates that fit the chip."""
    best = (math.inf, None)
    for tiles in candidates:
        try:
            elapsed = bench(functools.partial(fn, tiles))
        except OutOfResources:
            continue
        best = min(best, (elapsed, tiles), key=lambda b: b[0])
    return best


def routing(tokens: int, experts: int, top_k: int):
    logits = torch.randn(tokens, experts, device=DEVICE)
    return select_experts(logits, top_k, renormalize=True)


def tune_block_m(block_m, x, w13, w2, weights, ids) -> tuple[float, MoeConfig | None]:
    """The alignment's time plus the best of each GEMM's, for rows padded to block_m."""
    experts, top_k = w13.shape[0], ids.shape[1]
    align = align_assignments(ids, experts, block_m)
    t_align = bench(lambda: align_assignments(ids, experts, block_m))
    t_up, up = best_tiles(lambda t: gate_up_gemm(x, w13, align, top_k, block_m, t), GATE_UP_TILES[block_m])
    if up is None:
        return math.inf, None
    h = gate_up_gemm(x, w13, align, top_k, block_m, up)
    flat_weights = weights.reshape(-1).contiguous()
    t_down, down = best_tiles(lambda t: down_gemm(h, w2, flat_weights, align, block_m, t), DOWN_TILES[block_m])
    if down is None:
        return math.inf, None
    return t_align + t_up + t_down, MoeConfig(block_m, up, down)


def tune_bucket(tokens, experts, top_k, x, w13, w2) -> MoeConfig:
    """The best config for this token count."""
    weights, ids = routing(tokens, experts, top_k)
    results = [tune_block_m(block_m, x, w13, w2, weights, ids)
               for block_m in block_m_candidates(tokens * top_k / experts)]
    elapsed, config = min(results, key=lambda r: r[0])
    if config is None:
        raise RuntimeError(f"no candidate tiles ran for {tokens} tokens")
    return config


def check_and_time(tokens, experts, top_k, x, w13, w2, w13_f32, w2_f32, config, bandwidth) -> dict:
    weights, ids = routing(tokens, experts, top_k)
    out = fused_experts(x, w13, w2, weights, ids, config=config)
    ref = fused_experts_torch(x.float(), w13_f32, w2_f32, weights, ids)
    error = ((out.float() - ref).norm() / ref.norm()).item()
    hidden, inter = x.shape[1], w2.shape[2]
    touched = ids.unique().numel()
    floor_bytes = touched * 3 * inter * hidden * x.element_size() + 2 * tokens * hidden * x.element_size()
    return {
        "error": error,
        "fused_us": bench_graph(lambda: fused_experts(x, w13, w2, weights, ids, config=config)),
        "torch_us": bench(lambda: fused_experts_torch(x, w13, w2, weights, ids)),
        "floor_us": floor_bytes / bandwidth * 1e6,
        "tflop": tokens * top_k * 6 * hidden * inter / 1e12,
    }


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy of 2 GiB (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    seconds = do_bench(lambda: dst.copy_(src), warmup=5, rep=50) / 1e3
    return 2 * src.numel() * src.element_size() / seconds


def dump_configs(saved: dict) -> str:
    """JSON with one line per token bucket."""
    shapes = []
    for key, buckets in sorted(saved["configs"].items()):
        rows = [f'   "{tokens}": {json.dumps(buckets[tokens])}' for tokens in sorted(buckets, key=int)]
        shapes.append(f'  "{key}": {{\n' + ",\n".join(rows) + "\n  }")
    head = {k: v for k, v in saved.items() if k != "configs"}
    return (json.dumps(head)[:-1] + ', "configs": {\n' + ",\n".join(shapes) + "\n }}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=CONFIG_DIR, help="where fused_moe_<device>.json goes")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--buckets", default=",".join(map(str, BUCKETS)))
    args = parser.parse_args()
    begin = time.perf_counter()
    device_name = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    print(f"{device_name}, triton {triton.__version__}, torch {torch.__version__}: "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    path = config_path(device_name, args.out)
    saved = json.loads(path.read_text()) if path.exists() else {"configs": {}}
    saved.update(device=device_name, triton=triton.__version__)
    failures = 0
    header = (f"{'shape':18s} {'tokens':>6s} {'BM':>3s} {'gate_up tiles':>20s} {'down tiles':>20s} "
              f"{'fused us':>9s} {'floor us':>9s} {'floor %':>7s} {'TFLOP/s':>7s} {'torch us':>9s} {'rel err':>8s}")
    print(header)
    buckets = [int(b) for b in args.buckets.split(",")]
    for name in args.shapes.split(","):
        experts, top_k, hidden, inter = SHAPES[name]
        torch.manual_seed(0)
        x_all = torch.randn(max(buckets), hidden, device=DEVICE, dtype=DTYPE)
        w13 = (torch.randn(experts, 2 * inter, hidden, device=DEVICE) * hidden**-0.5).to(DTYPE)
        w2 = (torch.randn(experts, hidden, inter, device=DEVICE) * inter**-0.5).to(DTYPE)
        w13_f32, w2_f32 = w13.float(), w2.float()
        entry = saved["configs"].setdefault(shape_key(experts, hidden, inter, DTYPE), {})
        for tokens in buckets:
            x = x_all[:tokens]
            config = tune_bucket(tokens, experts, top_k, x, w13, w2)
            entry[str(tokens)] = config.to_json()
            r = check_and_time(tokens, experts, top_k, x, w13, w2, w13_f32, w2_f32, config, bandwidth)
            ok = r["error"] < 2e-2
            failures += not ok
            print(f"{name:18s} {tokens:6d} {config.block_m:3d} {str(config.gate_up):>20s} {str(config.down):>20s} "
                  f"{r['fused_us']:9.1f} {r['floor_us']:9.1f} {100 * r['floor_us'] / r['fused_us']:6.0f}% "
                  f"{r['tflop'] / r['fused_us'] * 1e6:7.1f} {r['torch_us']:9.1f} {r['error']:8.1e}"
                  f"{'' if ok else '  WRONG'}", flush=True)
        del w13, w2, w13_f32, w2_f32
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_configs(saved))
    print(f"wrote {path} in {time.perf_counter() - begin:.0f} s; {failures} wrong results "
          f"(copy it into {CONFIG_DIR} for the kernel to read)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
