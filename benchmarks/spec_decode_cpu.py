"""N-gram speculation on the CPU with the default model (SmolLM2-135M-Instruct): batch 1, greedy, on tasks
grounded in their input (repeat or lightly edit a given text), against plain decoding in the same process.

    .venv/bin/python benchmarks/spec_decode_cpu.py [--max-tokens 160] [--repeats 3]

Prints, per task and in total, tokens/s of both, the speed-up, whether the texts are identical, and the
acceptance rate and mean acceptance length of the speculative run.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tokenmill import LLM, SamplingParams
from tokenmill.default_model import default_model_path

CODE = '''def read_config(path):
    with open(path) as f:
        lines = f.readlines()
    config = {}
    for line in lines:
        key, value = line.strip().split("=")
        config[key] = value
    return config
'''
TEXT = ("The river rose through the night, and by morning the lower fields were under water. The farmers "
        "moved their animals to the hill, where the old church stood, and waited for the rain to stop.")
TASKS = {
    "repeat code": f"Repeat this Python function exactly:\n\n{CODE}",
    "rename in code": f"Rewrite this function with `path` renamed to `filename`, changing nothing else:\n\n{CODE}",
    "copy text": f"Copy this paragraph word for word:\n\n{TEXT}",
}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def run(llm: LLM, prompt: str, max_tokens: int, repeats: int) -> tuple[str, int, float]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    messages = [{"role": "user", "content": prompt}]
    llm.chat(messages, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
        times.append(time.perf_counter() - start)
    return out.text, len(out.token_ids), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    path = default_model_path()
    plain_llm = LLM(path, kv_cache_space=0.5, max_model_len=2048)
    spec_llm = LLM(path, kv_cache_space=0.5, max_model_len=2048, speculative_config=SPEC)
    totals = {"plain": [0, 0.0], "ngram": [0, 0.0]}
    print("| task | plain tok/s | ngram tok/s | speed-up | identical | acceptance | mean length |")
    print("|---|---|---|---|---|---|---|")
    for name, prompt in TASKS.items():
        before = spec_llm.engine.last_stats.spec_decoding if spec_llm.engine.last_stats else None
        text, n, plain_s = run(plain_llm, prompt, args.max_tokens, args.repeats)
        spec_text, spec_n, spec_s = run(spec_llm, prompt, args.max_tokens, args.repeats)
        stats = spec_llm.engine.last_stats.spec_decoding
        drafted = stats.num_draft_tokens - (before.num_draft_tokens if before else 0)
        accepted = stats.num_accepted_tokens - (before.num_accepted_tokens if before else 0)
        drafts = stats.num_drafts - (before.num_drafts if before else 0)
        totals["plain"][0] += n
        totals["plain"][1] += plain_s
        totals["ngram"][0] += spec_n
        totals["ngram"][1] += spec_s
        print(f"| {name} | {n / plain_s:.1f} | {spec_n / spec_s:.1f} | {plain_s / spec_s * spec_n / n:.2f}x | "
              f"{text == spec_text} | {accepted / max(1, drafted):.2f} | {1 + accepted / max(1, drafts):.2f} |")
    plain_rate = totals["plain"][0] / totals["plain"][1]
    spec_rate = totals["ngram"][0] / totals["ngram"][1]
    print(f"| all | {plain_rate:.1f} | {spec_rate:.1f} | {spec_rate / plain_rate:.2f}x | | | |")


if __name__ == "__main__":
    main()
