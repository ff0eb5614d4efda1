"""Prefill-side kernels alone on the GPU: paged prefill attention per tile config, q/k norm + rotary + KV write
per heads-per-program, on Llama-3.1-8B's heads (32 query / 8 KV heads of 128) and Qwen3-0.6B's (16 / 8, q/k norms),
and SiLU-and-mul with its output quantized to e4m3 (the FP8 down_proj's input) per warp count.

    PYTHONUNBUFFERED=1 python3 benchmarks/prefill_kernels.py [--compare-with OLD/tokenmill/kernels/prefill_attention.py]

Attention: TFLOP/s (causal FLOPs only) for the default config and a sweep of (BLOCK_M, BLOCK_N, warps, stages), over
8 x 1,024 and 64 x 1,024 causal prompts, 4 x 512 tokens after 1,536 cached, and 1 x 8,192; --compare-with times
another version of kernels/prefill_attention.py beside it (a file of an older checkout) and says whether the two
outputs are bitwise equal. Rotary: microseconds per call inside a CUDA graph of 10 calls, from 1 to 8,192 tokens.
SiLU (--sections silu): Llama-3.1-8B's 14,336 features at 1,024 and 8,192 rows, one program a row at 8, 16 (the
engine's) and 32 warps, against the unfused pair (bf16 SiLU-and-mul, then quantize_fp8), in bytes moved per second
(the row's gate and up read, its e4m3 written); each warp count's output checked bitwise against the engine's.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import triton
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "kernels"))

import cases  # noqa: E402

from tokenmill.kernels import prefill_attention  # noqa: E402
from tokenmill.kernels.activation import _silu_and_mul_kernel, silu_and_mul, silu_and_mul_fp8  # noqa: E402
from tokenmill.kernels.fp8_gemm import quantize_fp8  # noqa: E402
from tokenmill.kernels.qk_norm_rope_cache import qk_norm_rope_cache  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
CONFIGS = [None, (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3),
           (64, 128, 4, 2), (128, 128, 4, 2)]
POINTS = [("8 x 1,024 causal", 8, 1024, 0), ("64 x 1,024 causal", 64, 1024, 0), ("4 x 512 after 1,536", 4, 512, 1536),
          ("1 x 8,192 causal", 1, 8192, 0)]


def attention_point(num_reqs: int, new_len: int, cached: int):
    """The kernel's arguments for num_reqs requests of new_len tokens after `cached` ones, and its FLOPs."""
    seq_len = new_len + cached
    num_blocks = num_reqs * (seq_len // BLOCK_SIZE + 1)
    pool = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    block_table = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(num_reqs, -1)
    query = torch.randn(num_reqs * new_len, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    starts = torch.arange(0, num_reqs + 1, device="cuda", dtype=torch.int32) * new_len
    seq_lens = torch.full((num_reqs,), seq_len, device="cuda", dtype=torch.int32)
    req_ids = torch.arange(num_reqs, device="cuda", dtype=torch.int32)
    flops = 4 * num_reqs * HEADS * HEAD_DIM * (new_len * cached + new_len * (new_len + 1) / 2)
    out = torch.empty_like(query)
    return (query, pool, out, starts, seq_lens, block_table, req_ids, new_len, HEAD_DIM**-0.5), flops


def bench_attention(compare_with: str | None) -> None:
    other = None
    if compare_with is not None:
        spec = importlib.util.spec_from_file_location("other_prefill_attention", compare_with)
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
    for label, *point in POINTS:
        args, flops = attention_point(*point)
        row = []
        if other is not None:
            theirs = (args[0], args[1], torch.empty_like(args[0]), *args[3:])
            other.prefill_attention(*theirs)
            prefill_attention.prefill_attention(*args)
            same = torch.equal(args[2], theirs[2])
            ms = do_bench(functools.partial(other.prefill_attention, *theirs), warmup=10, rep=100,
                          return_mode="median")
            row.append(f"other {flops / ms / 1e9:.0f} (bitwise {'equal' if same else 'different'})")
        for config in CONFIGS:
            ms = do_bench(functools.partial(prefill_attention.prefill_attention, *args, config=config), warmup=10,
                          rep=100, return_mode="median")
            row.append(f"{config or 'default'} {flops / ms / 1e9:.0f}")
        print(f"attention {label}: TFLOP/s " + " | ".join(row), flush=True)


def bench_rotary() -> None:
    for name, heads, kv_heads, norm in (("llama-3.1-8b", 32, 8, False), ("qwen3-0.6b", 16, 8, True)):
        for num_tokens in (1, 16, 64, 256, 1024, 8192):
            qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            q, k, v = cases.split_qkv(qkv, heads, kv_heads, HEAD_DIM)
            positions = torch.randint(0, 4096, (num_tokens,), device="cuda")
            num_blocks = num_tokens // BLOCK_SIZE + 4
            pool = torch.zeros(2, num_blocks, BLOCK_SIZE, kv_heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:num_tokens].to(torch.int32)
            table = cases.rope_table(HEAD_DIM, "cuda")
            head_norm = SimpleNamespace(weight=torch.ones(HEAD_DIM, device="cuda", dtype=torch.bfloat16), eps=1e-6,
                                        offset=0.0) if norm else None
            row = []
            for per_program in (1, 2, 4, 8):
                call = functools.partial(qk_norm_rope_cache, positions, q, k, v, pool, slots, table, head_norm,
                                         head_norm, heads_per_program=per_program)
                call()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(10):
                        call()
                us = do_bench(graph.replay, warmup=20, rep=200, return_mode="median") * 100
                row.append(f"{per_program} heads/program {us:.2f} us")
            print(f"rotary {name} {num_tokens} tokens: " + " | ".join(row), flush=True)


def bench_silu_fp8() -> None:
    for rows in (1024, 8192):
        print(silu_fp8_point(rows, 14336), flush=True)


def silu_fp8_point(rows: int, d: int) -> str:
    x = torch.randn(rows, 2 * d, device="cuda", dtype=torch.bfloat16)
    engine_q, engine_scales = silu_and_mul_fp8(x)
    gigabytes = rows * d * (2 * 2 + 1) / 1e9
    unfused_ms = do_bench(lambda: quantize_fp8(silu_and_mul(x)), warmup=20, rep=200, return_mode="median")
    row = [f"unfused {unfused_ms * 1e3:.0f} us"]
    for warps in (8, 16, 32):
        q = torch.empty(rows, d, device="cuda", dtype=torch.float8_e4m3fn)
        scales = torch.empty(rows, 1, device="cuda", dtype=torch.float32)
        fused = functools.partial(_silu_and_mul_kernel[(rows, 1)], x, q, scales, x.stride(0), q.stride(0), d,
                                  BLOCK=triton.next_power_of_2(d), QUANTIZE_FP8=True, num_warps=warps)
        fused()
        same = torch.equal(q.view(torch.uint8), engine_q.view(torch.uint8)) and torch.equal(scales, engine_scales)
        ms = do_bench(fused, warmup=20, rep=200, return_mode="median")
        row.append(f"{warps} warps {ms * 1e3:.0f} us {gigabytes / ms:.2f} TB/s{'' if same else ' DIFFERENT'}")
    return f"silu+fp8 {rows} x {d}: " + " | ".join(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compare-with", default=None, help="another kernels/prefill_attention.py to time beside")
    parser.add_argument("--sections", default="attention,rotary")
    args = parser.parse_args()
    torch.manual_seed(0)
    sections = args.sections.split(",")
    if "attention" in sections:
        bench_attention(args.compare_with)
    if "rotary" in sections:
        bench_rotary()
    if "silu" in sections:
        bench_silu_fp8()


if __name__ == "__main__":
    main()
