"""W4A16 GEMMs (kernels.w4a16_gemm) against bf16 (skinny GEMM / cuBLAS) on Llama-3.1-8B's projections, group 128.

python benchmarks/w4a16_gemm.py [--sweep]  (on a CUDA device)
python benchmarks/w4a16_gemm.py --large-rows [--bits 8] [--group 32] [--zero] [--act-order] [--dequant-sweep]

Per row count, each projection's time for the kernel int_weight_gemm picks and for bf16; at 1-4 rows also the
skinny kernel, and with --sweep the GEMV's (BLOCK_N, BLOCK_K, warps, stages) configs (each one compiles once per
row count: 18 at one row, 13 at four).

--large-rows: from 5 rows on, int_weight_gemm's choice ("engine"), the skinny kernel (up to 16 rows), the
dequantization into the shared scratch then cuBLAS (dequant_int_gemm), the dequantization alone, and bf16 cuBLAS on
the same (dequantized) weight; each output's largest error against the float32 product, relative to its largest
value. The totals over the four projections say whether int_weight_gemm's choices by row count are right. Each
call is timed inside a CUDA graph of 10 calls, as the engine replays it (eagerly, a call whose GPU work is shorter
than its Python launch path would time the host).
--dequant-sweep: dequantize_int_weight's (BLOCK_N, BLOCK_K, warps) on gate_up.

--graph-sweep [--out DIR]: the GEMV's tiles with splits of K (kernels.split_k) at 1 and 4 rows, int4 group 128
symmetric (W1's GPTQ checkpoint), each config timed as 32 layers' distinct weights launched back to back in a CUDA
graph (as a decode step runs them: no weight served from L2); the best per (shape, rows) to
DIR/int_gemv_<device>.json, the table the engine reads from tokenmill/kernels/configs; then the four projections
of 32 layers chained, with the old tiles, the best without splits and the best.

--mma-sweep [--out DIR]: the tensor-core GEMV's (column tiles a warp, warps, splits of K, groups a step)
(kernels.int4_mma_gemv), int4 group 128 symmetric, timed the same way at 1 row; the best of each shape also at 2-4
and 8 rows with its error against the float64 product, against the CUDA-core GEMV (its tiles table) at 1-4 rows;
per shape the best tiles and the fewest rows from which they win to DIR/int4_mma_gemv_<device>.json; then the four
projections of 32 layers chained at 1, 4 and 8 rows: the CUDA-core GEMV as the engine ran it before (its tiles
table; 8 rows: twice at 4) against the tensor-core one with the best tiles.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

import torch
import triton

from tokenmill.kernels.dequant_scratch import dequant_scratch, reserve_dequant_scratch
from tokenmill.kernels.fused_moe import config_path
from tokenmill.kernels.int4_mma_gemv import MMA_MAX_ROWS, gemv_int4_mma, mma_gemv_key
from tokenmill.kernels.precompile import precompile
from tokenmill.kernels.skinny_gemm import skinny_gemm, skinny_gemm_applies
from tokenmill.kernels.w4a16_gemm import (
    GEMV_MAX_ROWS,
    GEMV_TUNED_ROWS,
    SKINNY_MAX_ROWS,
    dequant_int_gemm,
    dequantize_int_weight,
    gemv_int,
    gemv_int_up_to_8_rows,
    gemv_key,
    int_weight_gemm,
    skinny_int_gemm,
)
from tokenmill.layers.quant.w4a16 import dequantize_int, pack_int32

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# BLOCK_N 2-16, 64-256 words per column per step over at most BLOCK_K / 8 / 32 warps (more would send the words
# through shared memory, kernels.w4a16_gemm._gemv_int_kernel; with 32 per thread and column or more they load 4
# at a time: _gemv_unit), at most 32 words per thread, from 3 rows 16 and 8 columns (registers: 16 columns spill); the
# GEMV has no shared-memory pipeline, so num_stages stays 1. 26 configs at 1 row, 19 at 4.
GEMV_CONFIGS = [(bn, bk, w, 1) for bn, (bk, w) in itertools.product(
    (2, 4, 8, 16), ((512, 2), (1024, 1), (1024, 2), (1024, 4), (2048, 2), (2048, 4), (2048, 8)))
    if bn * bk // 8 // (32 * w) <= 32]


def gemv_configs(rows: int) -> list[tuple[int, int, int, int]]:
    return [c for c in GEMV_CONFIGS if rows <= 2 or (c[0] <= 8 and c[0] * c[1] // 8 // (32 * c[2]) <= 16)]


def us(fn) -> float:
    return triton.testing.do_bench(fn) * 1e3


GRAPH_REPS = 10


def graph_us(fn) -> float:
    """The GPU time of one call, as the engine's CUDA graphs replay it: GRAPH_REPS calls captured in a graph (an
    eager call whose GPU work is shorter than its Python launch path would time the host)."""
    fn()  # compiles, allocates the scratch, remembers which tiles do not fit: nothing of that in the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_REPS):
            fn()
    return triton.testing.do_bench(graph.replay) * 1e3 / GRAPH_REPS


def sweep_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=20) * 1e3  # shorter: many configs


LARGE_ROWS = (5, 8, 16, 32, 64, 128, 256, 1024, 4096)
# (BLOCK_N, BLOCK_K as words per row, warps) for --dequant-sweep: 4-16 words per thread (registers)
DEQUANT_CONFIGS = [(bn, words, w) for bn, words, w in itertools.product((8, 16, 32, 64), (16, 32, 64, 128), (4, 8))
                   if 4 <= bn * words // (32 * w) <= 16]


def make_weight(n: int, k: int, bits: int, group: int, zero: bool, act_order: bool):
    """Random packed integers, fp16 scales (and zeros), a permutation: int_weight_gemm's arguments after x."""
    groups = 1 if group == 0 else k // group
    q = pack_int32(torch.randint(0, 1 << bits, (n, k), device="cuda"), bits, dim=1)
    scale = torch.rand(n, groups, device="cuda").half() * 0.01 + 0.001
    zeros = torch.randint(0, 1 << bits, (n, groups), device="cuda").half() if zero else None
    perm = torch.randperm(k, device="cuda").to(torch.int32) if act_order else None
    return q, scale, zeros, perm, bits


def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def large_rows(args) -> None:
    print(f"int{args.bits} group {args.group or 'per-channel'}{' zeros' if args.zero else ''}"
          f"{' act-order' if args.act_order else ''}: times in us; errors: largest |out - ref| / largest |ref| "
          "against the float32 product", flush=True)
    weights = {name: make_weight(n, k, args.bits, args.group, args.zero, args.act_order)
               for name, (n, k) in SHAPES.items()}
    dense = {name: dequantize_int(w[0], w[1], w[2], args.bits, torch.bfloat16) for name, w in weights.items()}
    # As the layers do at load: the scratch sized once for the largest projection.
    reserve_dequant_scratch(torch.device("cuda", torch.cuda.current_device()), max(n * k for n, k in SHAPES.values()))
    header = (f"{'rows':>5} {'proj':8} {'engine':>9} {'skinny':>9} {'dq+mm':>9} {'dq only':>9} {'bf16':>9}   "
              f"{'err engine':>10} {'err dq':>9} {'err bf16':>9}")
    print(header, flush=True)
    nothing = float("nan")
    for rows in LARGE_ROWS:
        totals = dict(engine=0.0, skinny=0.0, dq=0.0, dq_only=0.0, bf16=0.0)
        for name, (n, k) in SHAPES.items():
            w, wd = weights[name], dense[name]
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            xs = x if w[3] is None else x.index_select(1, w[3])
            ref = xs.float() @ wd.float().T
            times = dict(
                engine=graph_us(functools.partial(int_weight_gemm, x, *w)),
                skinny=graph_us(functools.partial(skinny_int_gemm, x, *w)) if rows <= SKINNY_MAX_ROWS else nothing,
                dq=graph_us(functools.partial(dequant_int_gemm, x, *w)),
                dq_only=graph_us(functools.partial(dequantize_int_weight, w[0], w[1], w[2], args.bits,
                                                   dequant_scratch(x.device, x.dtype, n, k))),
                bf16=graph_us(functools.partial(torch.mm, xs, wd.T)),
            )
            for key, t in times.items():
                totals[key] += t
            errors = (max_error(int_weight_gemm(x, *w), ref), max_error(dequant_int_gemm(x, *w), ref),
                      max_error(xs @ wd.T, ref))
            print(f"{rows:5d} {name:8s} " + " ".join(f"{t:9.1f}" for t in times.values())
                  + f"   {errors[0]:10.2e} {errors[1]:9.2e} {errors[2]:9.2e}", flush=True)
        print(f"{rows:5d} {'all four':8s} " + " ".join(f"{t:9.1f}" for t in totals.values())
              + f"   engine {totals['engine'] / totals['bf16']:.2f}x bf16's time", flush=True)
    if args.dequant_sweep:
        n, k = SHAPES["gate_up"]
        q, scale, zero, _, bits = weights["gate_up"]
        out = dequant_scratch(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16, n, k)
        results = []
        for block_n, words, warps in DEQUANT_CONFIGS:
            config = (block_n, words * (32 // bits), warps)
            t = sweep_us(functools.partial(dequantize_int_weight, q, scale, zero, bits, out, config))
            results.append((t, config))
        bytes_moved = n * k * (2 + bits / 8)
        for t, config in sorted(results)[:8]:
            print(f"dequantize gate_up {config}: {t:.1f} us, {bytes_moved / t / 1e6:.2f} TB/s", flush=True)


SPLITS = (1, 2, 4, 8)
LAYERS = 32


def graph_sweep(args) -> None:
    from skinny_gemm import time_graph  # benchmarks/: 32 launches captured in one graph, ms per replay

    bits, group = 4, 128
    weights = {name: [make_weight(n, k, bits, group, False, False)[:3] for _ in range(LAYERS)]
               for name, (n, k) in SHAPES.items()}
    configs = {rows: [(*c[:4], splits) for c in gemv_configs(rows) for splits in SPLITS] for rows in GEMV_TUNED_ROWS}
    inputs = {(rows, k): torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
              for rows in GEMV_TUNED_ROWS for k in {k for _, k in SHAPES.values()}}

    def every_variant() -> None:
        for rows in GEMV_TUNED_ROWS:
            for name, (_, k) in SHAPES.items():
                for config in configs[rows]:
                    gemv_int(inputs[rows, k], *weights[name][0], None, bits, config=config)

    print(f"compiling {precompile(every_variant, torch.device('cuda'))} variants", flush=True)
    best = {}
    for rows in GEMV_TUNED_ROWS:
        for name, (n, k) in SHAPES.items():
            x, ws = inputs[rows, k], weights[name]
            q, scale, _ = ws[0]
            ref = x.double() @ dequantize_int(q, scale, None, bits, torch.float64).T
            timed = []
            for config in configs[rows]:
                out = gemv_int(x, *ws[0], None, bits, config=config)
                assert max_error(out, ref) < 2e-2, (name, rows, config, max_error(out, ref))
                timed.append((time_graph(lambda c=config, x=x, ws=ws: [gemv_int(x, *w, None, bits, config=c)
                                                                        for w in ws]) / LAYERS * 1e3, config))
            top, unsplit = min(timed), min(t for t in timed if t[1][4] == 1)
            best[rows, name] = (top[1], unsplit[1])
            floor = n * k * bits / 8 / 4.25e6
            print(f"rows {rows} {name:8s} best {top[0]:6.1f} us {top[1]}   without splits {unsplit[0]:6.1f} us "
                  f"{unsplit[1]}   (the weight at 4.25 TB/s: {floor:.1f} us)", flush=True)
    if args.out is not None:
        path = config_path(torch.cuda.get_device_name(), args.out, kind="int_gemv")
        table = {gemv_key(*SHAPES[name], rows, bits, group): list(c[0]) for (rows, name), c in best.items()}
        path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                                    "configs": dict(sorted(table.items()))}, indent=1) + "\n")
        print(f"wrote {path}", flush=True)
    for rows in GEMV_TUNED_ROWS:
        x0 = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)

        def chain(pick, rows=rows, x0=x0):
            x = x0
            for layer in range(LAYERS):
                for name, (_, k) in SHAPES.items():
                    x = gemv_int(x[:, :k], *weights[name][layer], None, bits, config=pick(name, rows))
            return x

        old = {name: _gemv_config_before_the_split_sweep(n, k, rows) for name, (n, k) in SHAPES.items()}
        for label, pick in (("tiles before the split sweep", lambda name, rows, old=old: old[name]),
                            ("best without splits", lambda name, rows: best[rows, name][1]),
                            ("best", lambda name, rows: best[rows, name][0])):
            print(f"== GEMV chain, rows {rows}, 32 layers x 4 projections, {label}: "
                  f"{time_graph(lambda pick=pick: chain(pick)):.3f} ms", flush=True)


MMA_CONFIGS = [(tm, warps, splits, kg) for tm in (1, 2) for warps in (1, 2, 4) for splits in (1, 2, 4, 8)
               for kg in (1, 2, 4)]


def mma_sweep(args) -> None:
    from skinny_gemm import time_graph  # benchmarks/: 32 launches captured in one graph, ms per replay

    bits, group = 4, 128
    weights = {name: [make_weight(n, k, bits, group, False, False)[:3] for _ in range(LAYERS)]
               for name, (n, k) in SHAPES.items()}
    inputs = {(rows, k): torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
              for rows in (1, 4, MMA_MAX_ROWS) for k in {k for _, k in SHAPES.values()}}
    fitting = {name: [c for c in MMA_CONFIGS if n % (16 * c[0] * c[1]) == 0 and (k // group) % (c[2] * c[3]) == 0]
               for name, (n, k) in SHAPES.items()}

    def every_variant() -> None:
        for name, (_, k) in SHAPES.items():
            for config in fitting[name]:
                gemv_int4_mma(inputs[1, k], *weights[name][0], config=config)

    print(f"compiling {precompile(every_variant, torch.device('cuda'))} variants", flush=True)
    best, fewest = {}, {}
    for name, (n, k) in SHAPES.items():
        ws = weights[name]
        timed = sorted((time_graph(lambda c=config, x=inputs[1, k], ws=ws: [gemv_int4_mma(x, *w, config=c) for w in ws])
                        / LAYERS * 1e3, config) for config in fitting[name])
        best[name] = timed[0][1]
        floor = n * k * bits / 8 / 4.25e6
        print(f"{name:8s} 1 row: " + "  ".join(f"{c} {t:.1f}" for t, c in timed[:6])
              + f" us   (the weight at 4.25 TB/s: {floor:.1f} us)", flush=True)
        q, scale, _ = ws[0]
        fewest[name] = GEMV_MAX_ROWS + 1  # past 4 rows the CUDA-core GEMV launches twice: it always loses
        for rows in (1, 2, 3, 4, MMA_MAX_ROWS):
            x = inputs.setdefault((rows, k), torch.randn(rows, k, device="cuda", dtype=torch.bfloat16))
            ref = x.double() @ dequantize_int(q, scale, None, bits, torch.float64).T
            error = max_error(gemv_int4_mma(x, q, scale, None, config=best[name]), ref)
            assert error < 2e-2, (name, rows, best[name], error)
            t = time_graph(lambda x=x, ws=ws, c=best[name]: [gemv_int4_mma(x, *w, config=c) for w in ws]) / LAYERS
            line = f"{name:8s} {rows} rows at {best[name]}: {t * 1e3:.1f} us, error {error:.1e}"
            if rows <= GEMV_MAX_ROWS:
                t_cores = time_graph(lambda x=x, ws=ws: [gemv_int(x, *w, None, bits) for w in ws]) / LAYERS
                line += f"; CUDA-core GEMV {t_cores * 1e3:.1f} us"
                if t <= t_cores:
                    fewest[name] = min(fewest[name], rows)
            print(line, flush=True)
    if args.out is not None:
        path = config_path(torch.cuda.get_device_name(), args.out, kind="int4_mma_gemv")
        table = {mma_gemv_key(*SHAPES[name], group): [*c, fewest[name]] for name, c in best.items()}
        path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                                    "configs": dict(sorted(table.items()))}, indent=1) + "\n")
        print(f"wrote {path}", flush=True)
    for rows in (1, 4, MMA_MAX_ROWS):
        x0 = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)

        def chain(gemv, x0=x0):
            x = x0
            for layer in range(LAYERS):
                for name, (_, k) in SHAPES.items():
                    x = gemv(x[:, :k].contiguous(), weights[name][layer], name)
            return x

        before = time_graph(lambda: chain(lambda x, w, name: gemv_int_up_to_8_rows(x, *w, None, bits)))
        after = time_graph(lambda: chain(lambda x, w, name: gemv_int4_mma(x, *w, config=best[name])))
        print(f"== GEMV chain, rows {rows}, 32 layers x 4 projections: CUDA cores {before:.3f} ms, "
              f"tensor cores {after:.3f} ms ({before / after:.2f}x)", flush=True)


def _gemv_config_before_the_split_sweep(n: int, k: int, rows: int) -> tuple[int, int, int, int]:
    """The engine's tiles for int4 g128 from the sixth session's sweep (kernels.w4a16_gemm._TUNED_GEMV)."""
    from tokenmill.kernels.w4a16_gemm import _TUNED_GEMV

    return _TUNED_GEMV[n, k, rows <= 2, 4, 128]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--large-rows", action="store_true")
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8))
    parser.add_argument("--group", type=int, default=128, help="0: per-channel")
    parser.add_argument("--zero", action="store_true", help="asymmetric: zero points")
    parser.add_argument("--act-order", action="store_true")
    parser.add_argument("--dequant-sweep", action="store_true")
    parser.add_argument("--rows", default="1,4,16,256,2048", help="row counts, comma-separated (without --large-rows)")
    parser.add_argument("--graph-sweep", action="store_true")
    parser.add_argument("--mma-sweep", action="store_true")
    parser.add_argument("--out", type=Path,
                        help="--graph-sweep / --mma-sweep: write the best tiles to DIR/<kind>_<device>.json")
    args = parser.parse_args()
    if args.mma_sweep:
        mma_sweep(args)
        return
    if args.graph_sweep:
        graph_sweep(args)
        return
    if args.large_rows:
        large_rows(args)
        return
    for rows in map(int, args.rows.split(",")):
        total_int, total_dense = 0.0, 0.0
        for name, (n, k) in SHAPES.items():
            q = pack_int32(torch.randint(0, 16, (n, k), device="cuda"), 4, dim=1)
            scale = torch.rand(n, k // 128, device="cuda").half() * 0.01
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            t_int = us(functools.partial(int_weight_gemm, x, q, scale, None, None, 4))
            t_dense = us(functools.partial(skinny_gemm, x, w) if skinny_gemm_applies(x, w)
                         else functools.partial(torch.matmul, x, w.T))
            total_int, total_dense = total_int + t_int, total_dense + t_dense
            line = f"rows {rows:5d} {name:8s} int4 g128 {t_int:8.1f} us   bf16 {t_dense:8.1f} us"
            if rows <= GEMV_MAX_ROWS:
                t_skinny = us(functools.partial(skinny_int_gemm, x, q, scale, None, None, 4))
                line += f"   (skinny {t_skinny:.1f} us; the weight at 4.25 TB/s: {n * k / 2 / 4.25e6:.1f} us)"
                if args.sweep:
                    best = min((sweep_us(functools.partial(gemv_int, x, q, scale, None, None, 4, config=c)), c)
                               for c in gemv_configs(rows))
                    line += f"   best GEMV {best[0]:.1f} us at {best[1]}"
            print(line, flush=True)
        print(f"rows {rows:5d} all four: int4 {total_int:.1f} us, bf16 {total_dense:.1f} us "
              f"(x32 layers: {total_int * 32 / 1e3:.2f} vs {total_dense * 32 / 1e3:.2f} ms)", flush=True)


if __name__ == "__main__":
    main()
