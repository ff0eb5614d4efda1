"""Where a prefill-heavy run's GPU time goes (W4's shape), by kernel family, for bf16 and FP8 weights.

    PYTHONUNBUFFERED=1 python3 benchmarks/prefill_anatomy.py [--quantization fp8] [--num-prompts 64]

One engine on Llama-3.1-8B dummy weights runs N prompts of 1,024 random tokens with one output token each (only
prefill steps, 8,192-token budget), once to warm up and once under torch.profiler. Printed: wall time, the kernels'
GPU time by family (GEMM, attention, activation quantization, norms, ...) with the FLOP rate the GEMMs reached, and
the GPU's idle share (host-bound steps show up there).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FAMILIES = [  # first match wins
    ("gemm", re.compile(r"gemm|nvjet|cutlass|sm90_xmma|matmul|scaled_mm|_mm_|skinny|gemv", re.I)),
    ("prefill attention", re.compile(r"prefill|flash|attn_fwd|unified_attention", re.I)),
    ("decode attention", re.compile(r"decode", re.I)),
    ("activation quant", re.compile(r"quant|fp8|scale", re.I)),
    ("rotary + KV write", re.compile(r"rope|rotary|cache", re.I)),
    ("norm", re.compile(r"norm", re.I)),
    ("silu", re.compile(r"silu|act_and_mul|swiglu", re.I)),
    ("sampling", re.compile(r"sampl|argmax|topk|softmax|gumbel", re.I)),
    ("copies", re.compile(r"copy|memcpy|memset|fill|cat|index", re.I)),
]


def family_of(name: str) -> str:
    for family, pattern in FAMILIES:
        if pattern.search(name):
            return family
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ROOT / "benchmarks/models/llama-3.1-8b"))
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--top", type=int, default=12, help="kernels listed by name")
    args = parser.parse_args()

    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.offline import vocab_size_of

    llm = LLM(args.model, load_format="dummy", quantization=args.quantization, max_model_len=2048,
              skip_tokenizer_init=True)
    vocab = vocab_size_of(llm)

    def prompts(seed: int) -> list[dict]:
        rng = np.random.default_rng(seed)
        return [{"prompt_token_ids": rng.integers(3, vocab, args.input_len).tolist()}
                for _ in range(args.num_prompts)]

    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    llm.generate(prompts(1), params, use_tqdm=False)  # warm-up (and no prefix-cache hits below: other seeds)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts(2), params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_family: dict[str, float] = collections.defaultdict(float)
    by_name: dict[str, float] = collections.defaultdict(float)
    intervals = []
    for event in events:
        us = event.device_time
        by_family[family_of(event.name)] += us
        by_name[event.name] += us
        intervals.append((event.time_range.start, event.time_range.end))
    intervals.sort()
    busy, end = 0.0, -1.0
    for a, b in intervals:
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    tokens = args.num_prompts * args.input_len
    layers = 32
    hidden, inter, kv = 4096, 14336, 1024  # Llama-3.1-8B's projections: qkv, o, gate_up, down; LM head once
    flops_per_token = 2 * layers * (hidden * (hidden + 2 * kv) + hidden * hidden + hidden * 2 * inter + inter * hidden)
    gemm_s = by_family["gemm"] / 1e6
    print(f"quantization {args.quantization or 'none (bf16)'}: {args.num_prompts} x {args.input_len} prompt tokens "
          f"in {wall * 1e3:.0f} ms wall = {tokens / wall:,.0f} prompt tok/s; GPU busy {busy / 1e3:.0f} ms "
          f"({100 * busy / 1e6 / wall:.1f}% of wall)")
    print(f"  GEMMs of the layers: {flops_per_token * tokens / 1e12:.1f} TFLOP in {gemm_s * 1e3:.0f} ms of GEMM "
          f"kernels = {flops_per_token * tokens / gemm_s / 1e12:.0f} TFLOP/s (LM head included in the time)")
    total = sum(by_family.values())
    for family, us in sorted(by_family.items(), key=lambda kv: -kv[1]):
        print(f"  {family:20s} {us / 1e3:9.1f} ms  {100 * us / total:5.1f}%")
    print("  top kernels:")
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"    {us / 1e3:9.1f} ms  {name[:110]}")


if __name__ == "__main__":
    main()
