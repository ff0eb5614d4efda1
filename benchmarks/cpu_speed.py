"""Issue 23's CPU workload: offline output tokens/s of the default model, tokenmill or vLLM-CPU.

    python3 benchmarks/cpu_speed.py --dtype float32 --batch 64          # tokenmill, the GGUF default model
    python3 benchmarks/cpu_speed.py --batch 1 --gguf both               # GGUF kept quantized vs dequantized
    /tmp/vllm-cpu-venv/bin/python benchmarks/cpu_speed.py --engine vllm --model /tmp/smollm2-135m-hf \\
        --dtype float32 --batch 64

`--batch` prompts of 128 random token ids (seeded, ids from 3 up), 128 greedy output tokens each (ignore_eos;
sampled at `--temperature` above 0, `--top-p`), all submitted at once; one short warm-up generate, then
`--repeats` timed generates, each reported, and their median. Each run draws new prompts: repeating them would
hit the prefix cache and skip the prefill. Run r's prompts are the same for every engine and dtype. The script
imports only the engine it runs, so it works from vLLM's own venv. vLLM needs a Hugging Face folder: the GGUF
dequantized to safetensors (BENCHMARKS.md, CPU section, says how).

`--gguf` (tokenmill, a .gguf model): `kept` serves the linear layers from their GGML blocks (the default),
`dequantized` dequantizes at load (gguf_dequantize), `both` builds the two engines and alternates their
timed runs (kept, dequantized, kept, ...), so that load from other processes on the CPU falls on both.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def make_engine(args: argparse.Namespace, gguf_dequantize: bool = False):
    """generate(prompts, max_tokens) -> each prompt's output token ids, on the chosen engine."""
    if args.engine == "vllm":
        from vllm import LLM, SamplingParams

        # On the CPU gpu_memory_utilization is the share of memory vLLM reserves (weights + KV cache).
        llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, skip_tokenizer_init=True, seed=0,
                  gpu_memory_utilization=0.4)
    else:
        from tokenmill import LLM, SamplingParams
        from tokenmill.default_model import default_model_path

        budget = {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
        llm = LLM(args.model or default_model_path(), dtype=args.dtype, max_model_len=1024, skip_tokenizer_init=True,
                  gguf_dequantize=gguf_dequantize, **budget)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    return generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("tokenmill", "vllm"), default="tokenmill")
    parser.add_argument("--model", default=None, help="tokenmill: default model when omitted; vllm: an HF folder")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampled (unseeded)")
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature above 0: the nucleus")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokenmill: the step's token budget "
                        "(default: the engine's)")
    parser.add_argument("--dump-tokens", default=None, help="write the first run's output ids here (.npy)")
    parser.add_argument("--gguf", choices=("kept", "dequantized", "both"), default="kept",
                        help="tokenmill on a .gguf: linear weights kept quantized, dequantized at load, or both")
    args = parser.parse_args()

    def make_prompts(seed: int) -> list[list[int]]:
        rng = np.random.default_rng(seed)
        return [rng.integers(3, args.vocab_size, args.input_len).tolist() for _ in range(args.batch)]

    modes = {"kept": [False], "dequantized": [True], "both": [False, True]}[args.gguf] if args.engine == "tokenmill" \
        else [False]
    engines = {dequantize: make_engine(args, dequantize) for dequantize in modes}
    for generate in engines.values():
        generate(make_prompts(1000)[:1], 4)  # warm-up: first-call allocations and lazy initialisation
    rates: dict[bool, list[float]] = {dequantize: [] for dequantize in modes}
    for i in range(args.repeats):
        prompts = make_prompts(i)
        for dequantize, generate in engines.items():
            start = time.perf_counter()
            outputs = generate(prompts, args.output_len)
            elapsed = time.perf_counter() - start
            num_output = sum(len(o) for o in outputs)
            rates[dequantize].append(num_output / elapsed)
            label = f" ({'dequantized' if dequantize else 'kept'})" if len(modes) > 1 else ""
            print(f"run {i}{label}: {num_output} output tokens in {elapsed:.2f} s = {rates[dequantize][-1]:.1f} "
                  "output tok/s", flush=True)
            if i == 0 and args.dump_tokens and not dequantize:
                np.save(args.dump_tokens, np.array(outputs))
    for dequantize, runs in rates.items():
        is_gguf = args.engine == "tokenmill" and (args.model is None or args.model.endswith(".gguf"))
        gguf = f" gguf={'dequantized' if dequantize else 'kept'}" if is_gguf else ""
        each = ", ".join(f"{r:.1f}" for r in runs)
        sampled = f" temperature={args.temperature} top_p={args.top_p}" if args.temperature else ""
        print(f"RESULT engine={args.engine} dtype={args.dtype}{gguf}{sampled} batch={args.batch}: median "
              f"{statistics.median(runs):.1f} output tok/s over {len(runs)} runs ({each})")
    if len(modes) > 1:
        speedups = [kept / dense for kept, dense in zip(rates[False], rates[True])]
        print(f"RESULT kept/dequantized: median {statistics.median(speedups):.2f}x "
              f"({', '.join(f'{r:.2f}' for r in speedups)})")


if __name__ == "__main__":
    main()
