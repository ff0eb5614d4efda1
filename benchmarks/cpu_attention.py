"""The CPU paged-attention C kernel alone (attention.cpu_kernel): a decode step's attention over the
default model's shapes, optionally against other versions of cpu_kernel.py, alternated.

    python3 benchmarks/cpu_attention.py                                      # this tree's kernel
    git show HEAD:tokenmill/attention/cpu_kernel.py > /tmp/cpu_kernel_old.py
    python3 benchmarks/cpu_attention.py --against /tmp/cpu_kernel_old.py     # old and new, alternated

A step is `--layers` calls of paged_attention_cpu (the Python wrapper included, as the backend calls it),
each over its own layer's pool: `--batch` decodes (one query each) of each of `--contexts` tokens, the requests'
blocks shuffled over the pool, the block table shared by the layers as in the engine. So the keys and
values come from memory, not the caches, as in a real step. Each figure is the fastest of `--repeats`
steps (the machine may be shared), `--threads` threads. "max diff" is the largest difference between the
kernels' outputs. SmolLM2-135M's shapes by default: 9 query heads, 3 kv heads, head size 64.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch

from tokenmill.attention import cpu_kernel


def module_of(path: str):
    spec = importlib.util.spec_from_file_location("cpu_kernel_against", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_step(batch: int, context: int, layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks_per_req = -(-context // block_size)
    num_blocks = batch * blocks_per_req + 1
    block_table = torch.randperm(num_blocks, generator=g)[: batch * blocks_per_req].view(batch, blocks_per_req)
    pools = [torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
             for _ in range(layers)]
    queries = [torch.randn(batch, num_heads, head_dim, generator=g).to(dtype) for _ in range(layers)]
    query_start_loc = torch.arange(batch + 1, dtype=torch.int64)
    seq_lens = torch.full((batch,), context, dtype=torch.int64)
    return pools, queries, block_table.contiguous(), query_start_loc, seq_lens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--contexts", default="128,192,256")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", default="9,3,64", help="query heads, kv heads, head size")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--against", default=None, help="other cpu_kernel.py files (commas), timed alternately")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    kernels = {"this": cpu_kernel.paged_attention_cpu}
    for path in args.against.split(",") if args.against else []:
        kernels[path] = module_of(path).paged_attention_cpu
    num_heads, num_kv_heads, head_dim = (int(v) for v in args.heads.split(","))
    scale = head_dim**-0.5
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        for context in (int(v) for v in args.contexts.split(",")):
            pools, queries, block_table, qsl, seq_lens = make_step(
                args.batch, context, args.layers, num_heads, num_kv_heads, head_dim, args.block_size, dtype)
            times = {name: [] for name in kernels}
            outputs = {}
            for repeat in range(args.repeats + 1):  # the first: a warm-up (compile, page faults)
                order = list(kernels.items())
                for name, attend in order if repeat % 2 == 0 else order[::-1]:
                    start = time.perf_counter()
                    outputs[name] = [attend(q, pool, block_table, qsl, seq_lens, scale)
                                     for q, pool in zip(queries, pools)]
                    if repeat:
                        times[name].append(time.perf_counter() - start)
            best = {name: min(t) for name, t in times.items()}
            kv_bytes = 2 * args.batch * context * num_kv_heads * head_dim * pools[0].element_size()
            line = (f"{str(dtype):14} batch={args.batch} context={context}: {best['this'] * 1e3:7.2f} ms a step, "
                    f"{best['this'] / args.layers * 1e3:6.3f} ms a layer "
                    f"({kv_bytes * args.layers / best['this'] / 1e9:5.1f} GB/s of K/V)")
            for name in list(kernels)[1:]:
                diff = max((a.float() - b.float()).abs().max().item()
                           for a, b in zip(outputs["this"], outputs[name]))
                line += (f"\n    {name}: {best[name] * 1e3:7.2f} ms, this {best[name] / best['this']:.2f}x as fast, "
                         f"max diff {diff:.2e}")
            print(line, flush=True)


if __name__ == "__main__":
    main()
