"""Offline output tokens/s of the default model on the CPU at a given torch thread count and batch size.

    python3 benchmarks/cpu_threads.py --threads 1 --batch 16     # OMP_NUM_THREADS must not be set

Prompts of 128 token ids, 64 greedy output tokens each (ignore_eos), after one short warm-up generate.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # below the core count: the engine leaves it alone
    from tokenmill import LLM, SamplingParams
    from tokenmill.default_model import default_model_path

    llm = LLM(default_model_path(), kv_cache_space=0.5, max_model_len=1024)
    prompts = [{"prompt_token_ids": list(range(100 + i, 228 + i))} for i in range(args.batch)]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    print(f"threads={torch.get_num_threads()} batch={args.batch}: "
          f"{args.batch * args.output_len / elapsed:.1f} output tok/s ({elapsed:.1f} s)")


if __name__ == "__main__":
    main()
