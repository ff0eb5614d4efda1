"""Check and tune kernels.fused_moe on the GPU: correctness against fused_experts_torch, a sweep of tiles per
token bucket, and the tuned configs written to DIR/fused_moe_<device>.json (the file the kernel reads from
tokenmill/kernels/configs/).

    python benchmarks/fused_moe.py --out DIR [--shapes qwen3-30b-a3b,mixtral] [--buckets 1,16,256]
    python benchmarks/fused_moe.py --decode [--fp8 | --both] --out DIR [--shapes qwen3-30b-a3b,qwen3-30b-a3b-tp2]

Shapes: Qwen3-30B-A3B's experts (E=128, K=8, H=2048, I=768), its TP=2 slice (I=384), Mixtral-8x7B's (E=8,
K=2, H=4096, I=14336), in bfloat16 (float16 shares the tiles). For each bucket of tokens, the gate/up and
the down GEMM are timed separately for each candidate tiling of each candidate BLOCK_M (the two GEMMs are
independent launches), the best pair per BLOCK_M plus its alignment wins. Then the whole fused_experts runs
with the winner and is checked against the float32 torch path; the table gives its time, the time of the
bf16 torch path (a loop over experts), and the floor: the bytes of the experts actually touched (plus the
activations in and out) at the copy bandwidth measured here.

--decode tunes kernels.fused_moe_decode (the GEMV path of 1..4 tokens) instead: one config per shape, the
gate/up and down tiles (with their prefetch and split_k) each the fastest summed over T = 1, 2, 4 (a token's
bits then do not depend on T) of the candidates whose result was right (gate/up against float32, down against
the grouped GEMMs, and the same bits twice), written to DIR/fused_moe_decode_<device>.json; then each T is
checked and timed per layer (CUDA graph, L2 flushed) against the grouped GEMMs (with their tuned tiles), the
config the repository held (`before`: its tiles, this kernel) and the floor. --fp8: the same for e4m3 experts
with 128 x 128 block scales; --both: bf16 then e4m3, one file. The sweep of Qwen3-30B-A3B alone:

    PYTHONUNBUFFERED=1 python benchmarks/fused_moe.py --decode --both --shapes qwen3-30b-a3b --out DIR
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenmill.kernels.fused_moe import (  # noqa: E402
    CONFIG_DIR,
    FP8,
    MoeConfig,
    align_assignments,
    config_path,
    down_gemm,
    fused_experts,
    gate_up_gemm,
    shape_key,
)
from tokenmill.kernels.fused_moe_decode import (  # noqa: E402
    DecodeConfig,
    GemvTiles,
    decode_config_path,
    decode_down,
    decode_gate_up,
    decode_shape_key,
    fused_experts_decode,
    load_decode_configs,
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

# The decode path's candidates: GemvTiles (BLOCK_N, BLOCK_K, num_warps, num_stages, prefetch, split_k); the down
# kernel's BLOCK_K is per expert (its tile is BLOCK_N x top-k x BLOCK_K). Each tile without and with the next
# K-tile prefetched (two steps of weights in flight per program: half as wide a tile holds as many bytes in
# flight); the down kernel's narrow tiles also with the intermediate features split over 2 or 4 programs (more
# programs, fewer steps each, at a small T).
_GATE_UP_BASE = [(4, 512, 4, 3), (4, 1024, 4, 3), (4, 2048, 8, 3), (8, 512, 4, 3), (8, 1024, 8, 3), (16, 256, 4, 3),
                 (16, 512, 8, 3), (32, 128, 4, 3)]
_DOWN_BASE = [(2, 512, 4, 3), (4, 128, 4, 3), (4, 256, 8, 3), (8, 64, 4, 3), (8, 128, 8, 3), (16, 64, 8, 3),
              (32, 32, 4, 3)]
_DOWN_SPLIT = [(2, 128, 4, 3), (4, 64, 4, 3), (4, 128, 4, 3), (8, 64, 4, 3), (8, 128, 8, 3)]
DECODE_GATE_UP_TILES = [GemvTiles(*t, prefetch) for t in _GATE_UP_BASE for prefetch in (0, 1)]
DECODE_DOWN_TILES = ([GemvTiles(*t, prefetch) for t in _DOWN_BASE for prefetch in (0, 1)]
                     + [GemvTiles(*t, 1, split) for t in _DOWN_SPLIT for split in (2, 4)])
DECODE_TOKENS = (1, 2, 4)
FP8_BLOCK = 128  # --fp8: the block scales of the Qwen3 / DeepSeek-V3 FP8 releases


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


@dataclass
class Experts:
    """One layer's experts as the kernels take them: 16-bit, or e4m3 with block scales (--fp8)."""
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    scale_block: int = 0

    def scales(self) -> dict:
        return {"w13_scale": self.w13_scale, "w2_scale": self.w2_scale, "scale_block": self.scale_block}

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 weights (the reference's)."""
        return tuple(w.float() if s is None else dequantize_blocks(w, s, self.scale_block)
                     for w, s in ((self.w13, self.w13_scale), (self.w2, self.w2_scale)))


def quantize_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> e4m3 [E, N, K] and float32 scales [E, N / block, K / block], as the FP8 checkpoints hold."""
    e, n, k = w.shape
    tiles = w.float().reshape(e, n // block, block, k // block, block)
    scale = tiles.abs().amax(dim=(2, 4)).clamp_min(1e-12) / torch.finfo(FP8).max
    return (tiles / scale[:, :, None, :, None]).to(FP8).reshape(e, n, k), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    return q.float() * scale.repeat_interleave(block, dim=1).repeat_interleave(block, dim=2)


def make_experts(experts: int, hidden: int, inter: int, fp8: bool) -> Experts:
    w13 = (torch.randn(experts, 2 * inter, hidden, device=DEVICE) * hidden**-0.5).to(DTYPE)
    w2 = (torch.randn(experts, hidden, inter, device=DEVICE) * inter**-0.5).to(DTYPE)
    if not fp8:
        return Experts(w13, w2)
    (q13, s13), (q2, s2) = quantize_blocks(w13, FP8_BLOCK), quantize_blocks(w2, FP8_BLOCK)
    return Experts(q13, q2, s13, s2, FP8_BLOCK)


def floor_us(x, ids, w2, bandwidth) -> float:
    """The bytes of the experts actually touched, plus the activations in and out, at the copy bandwidth."""
    tokens, hidden = x.shape
    touched = ids[ids >= 0].unique().numel()
    expert_bytes = 3 * w2.shape[2] * hidden * w2.element_size()
    return (touched * expert_bytes + 2 * tokens * hidden * x.element_size()) / bandwidth * 1e6


def gate_up_reference(x, ex: Experts, ids, reference: tuple) -> torch.Tensor:
    """float32 silu(x W_gate^T) * (x W_up^T) of each assignment (ids flat, (token, k) order), the dequantized
    weights."""
    w13 = reference[0][ids]  # [T*K, 2I, H]
    gate, up = (w13 @ x.float().repeat_interleave(ids.numel() // x.shape[0], 0)[:, :, None])[..., 0].chunk(2, dim=1)
    return torch.nn.functional.silu(gate) * up


def rel_error(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def tune_decode(x_all, ex: Experts, top_k, reference: tuple) -> tuple[DecodeConfig, int]:
    """The gate/up and the down tiles with the least time summed over DECODE_TOKENS, and how many candidates
    gave a wrong result: gate/up against float32, down against the grouped GEMMs (kernels.fused_moe) on the
    same routing. Prints each candidate's us per T."""
    times_up = {tiles: [] for tiles in DECODE_GATE_UP_TILES}
    times_down = {tiles: [] for tiles in DECODE_DOWN_TILES}
    wrong = set()
    up_scale = {"scale": ex.w13_scale, "scale_block": ex.scale_block}
    down_scale = {"scale": ex.w2_scale, "scale_block": ex.scale_block}
    for tokens in DECODE_TOKENS:
        weights, ids = routing(tokens, ex.w13.shape[0], top_k)
        x = x_all[:tokens]
        grouped = fused_experts(x, ex.w13, ex.w2, weights, ids, **ex.scales())
        ids, weights = ids.reshape(-1).contiguous(), weights.reshape(-1).contiguous()
        h_ref = gate_up_reference(x, ex, ids, reference)
        for tiles in DECODE_GATE_UP_TILES:
            run = functools.partial(decode_gate_up, x, ex.w13, ids, top_k, tiles, **up_scale)
            if rel_error(run(), h_ref) > 2e-2:
                wrong.add(("gate/up", tiles))
            times_up[tiles].append(bench(run))
        h = decode_gate_up(x, ex.w13, ids, top_k, DECODE_GATE_UP_TILES[0], **up_scale)
        for tiles in DECODE_DOWN_TILES:
            run = functools.partial(decode_down, h, ex.w2, ids, weights, top_k, tiles, **down_scale)
            if rel_error(run(), grouped) > 2e-2 or not torch.equal(run(), run()):
                wrong.add(("down", tiles))
            times_down[tiles].append(bench(run))
    for name, times in (("gate/up", times_up), ("down", times_down)):
        print(f"  {name} tiles (block_n, block_k, warps, stages, prefetch, split_k): us at T={DECODE_TOKENS}, sum",
              flush=True)
        for tiles, us in sorted(times.items(), key=lambda item: sum(item[1])):
            flag = "  WRONG" if (name, tiles) in wrong else ""
            print(f"    {str(tuple(tiles)):28s} " + " ".join(f"{t:6.1f}" for t in us) + f"  {sum(us):7.1f}{flag}")
    best = [min((t for t in times if (name, t) not in wrong), key=lambda t: sum(times[t]))
            for name, times in (("gate/up", times_up), ("down", times_down))]
    return DecodeConfig(*best), len(wrong)


def time_decode(name: str, x, ex: Experts, reference: tuple, config: DecodeConfig, bandwidth: float) -> bool:
    """One row of the --decode table: the decode path against the grouped GEMMs and the floor; whether it is
    right (against the float32 torch path on the same, dequantized, weights)."""
    top_k = SHAPES[name][1]
    weights, ids = routing(x.shape[0], ex.w13.shape[0], top_k)
    out = fused_experts_decode(x, ex.w13, ex.w2, weights, ids, config=config, **ex.scales())
    ref = fused_experts_torch(x.float(), *reference, weights, ids)
    error = ((out.float() - ref).norm() / ref.norm()).item()
    t_decode = bench_graph(functools.partial(fused_experts_decode, x, ex.w13, ex.w2, weights, ids, config=config,
                                             **ex.scales()))
    # the grouped GEMMs, with their tuned tiles (16-bit tiles for fp8: it has no entries of its own)
    t_gemms = bench_graph(functools.partial(fused_experts, x, ex.w13, ex.w2, weights, ids, **ex.scales()))
    floor = floor_us(x, ids, ex.w2, bandwidth)
    print(f"{name:18s} {x.shape[0]:6d} {str(tuple(config.gate_up)):>22s} {str(tuple(config.down)):>22s} "
          f"{t_decode:9.1f} {t_gemms:9.1f} {floor:9.1f} {100 * floor / t_decode:6.0f}% {100 * floor / t_gemms:6.0f}% "
          f"{error:8.1e}{'' if error < 2e-2 else '  WRONG'}", flush=True)
    return error < 2e-2


def decode_main(args, device_name: str, bandwidth: float) -> int:
    """--decode: tune, check and time the decode path against the grouped GEMMs and the floor (per layer: one
    layer's experts, us of a CUDA-graph replay with L2 flushed); the config in CONFIG_DIR before, as `before`."""
    path = decode_config_path(device_name, args.out)
    saved = json.loads(path.read_text()) if path.exists() else {"configs": {}}
    saved.update(device=device_name, triton=triton.__version__)
    before = load_decode_configs(decode_config_path(device_name))
    failures = 0
    for fp8 in ((False, True) if args.both else (args.fp8,)):
        print(f"{'e4m3 experts, 128x128 block scales' if fp8 else 'bf16 experts'}\n"
              f"{'shape':18s} {'tokens':>6s} {'gate_up tiles':>22s} {'down tiles':>22s} {'decode us':>9s} "
              f"{'GEMMs us':>9s} {'floor us':>9s} {'decode':>7s} {'GEMMs':>7s} {'rel err':>8s}  (% of floor)")
        for name in args.shapes.split(","):
            experts, top_k, hidden, inter = SHAPES[name]
            torch.manual_seed(0)
            x_all = torch.randn(max(DECODE_TOKENS), hidden, device=DEVICE, dtype=DTYPE)
            ex = make_experts(experts, hidden, inter, fp8)
            reference = ex.dequantized()
            key = decode_shape_key(experts, hidden, inter, DTYPE, ex.scale_block if fp8 else None)
            config, wrong = tune_decode(x_all, ex, top_k, reference)
            failures += wrong
            saved["configs"][key] = config.to_json()
            failures += sum(not time_decode(name, x_all[:tokens], ex, reference, config, bandwidth)
                            for tokens in DECODE_TOKENS)
            if key in before and before[key] != config:
                print(f"{'  before':18s}")
                failures += sum(not time_decode(name, x_all[:tokens], ex, reference, before[key], bandwidth)
                                for tokens in DECODE_TOKENS)
            del ex, reference
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [f'  "{key}": {json.dumps(config)}' for key, config in sorted(saved["configs"].items())]
    head = json.dumps({k: v for k, v in saved.items() if k != "configs"})
    path.write_text(head[:-1] + ', "configs": {\n' + ",\n".join(rows) + "\n }}\n")
    print(f"wrote {path} in {time.perf_counter() - args.begin:.0f} s; {failures} wrong results (copy it into "
          f"{CONFIG_DIR} for the kernel to read)")
    return 1 if failures else 0


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
    parser.add_argument("--decode", action="store_true", help="tune and time the decode path (1..4 tokens)")
    parser.add_argument("--fp8", action="store_true", help="with --decode: e4m3 experts, 128x128 block scales")
    parser.add_argument("--both", action="store_true", help="with --decode: bf16 then e4m3 experts, one file")
    args = parser.parse_args()
    if args.decode and args.shapes == ",".join(SHAPES):
        args.shapes = "qwen3-30b-a3b,qwen3-30b-a3b-tp2"
    begin = args.begin = time.perf_counter()
    device_name = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    print(f"{device_name}, triton {triton.__version__}, torch {torch.__version__}: "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    if args.decode:
        return decode_main(args, device_name, bandwidth)
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
