"""Speculative decoding on the GPU: the mechanism's ceiling, and what speculation costs under load.

    PYTHONUNBUFFERED=1 python3 benchmarks/spec_decode.py --sections correct,oracle,load --out $OUT

Sections:
  correct  the CPU tests of speculative decoding, run on this device (float32 tiny models: tokens and
           logprobs equal plain decoding's; the rejection sampler's chi-square tests)
  oracle   Llama-3.1-8B (dummy weights), batch 1, 128 prompt / 512 output tokens, greedy: plain decoding
           against an oracle proposer that drafts the target's own greedy continuation (a benchmark-only
           proposer: every draft is accepted, so this is the ceiling of the verify-and-emit mechanism), k = 4
  load     the same model at batch 64 and 256 (128 / 256 tokens, random prompts), plain against n-gram
           speculation configured (k = 4): the draft budget must not make either slower
  W3, W4   BENCHMARKS.md's throughput workloads (benchmarks/gpu_check.py) with and without n-gram speculation
           configured, in subprocesses: within 2% of each other

The oracle's reference is plain decoding's greedy continuation. In bfloat16 a verify step's GEMMs round
differently from a one-token step's, so a near-tie may go the other way: from there the oracle has nothing
to propose and the run continues undrafted (the line reports how far each run followed the reference).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.scheduler.draft_budget import DraftBudget  # noqa: E402

LLAMA_8B = str(ROOT / "benchmarks/models/llama-3.1-8b")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
RESULTS: dict[str, str] = {}


def note(name: str, value: str) -> None:
    RESULTS[name] = value
    print(f"== {name}: {value}", flush=True)


class OracleProposer:
    """Drafts the known continuation of each sequence (benchmark only: it is never a user's choice)."""

    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences = sequences

    def propose(self, states, rows: np.ndarray, max_drafts: np.ndarray) -> list[np.ndarray]:
        drafts = []
        for row, k in zip(rows.tolist(), max_drafts.tolist()):
            length = int(states.num_tokens[row])
            prefix = states.token_ids[row, :length].tolist()
            found = next((s[length : length + k] for s in self.sequences if s[:length] == prefix), [])
            drafts.append(np.array(found, dtype=np.int64))
        return drafts


def make_llm(**kwargs) -> LLM:
    return LLM(LLAMA_8B, load_format="dummy", skip_tokenizer_init=True, max_model_len=2048, **kwargs)


def release() -> None:
    """Frees the GPU memory of engines the caller has dropped (`del llm` first)."""
    gc.collect()
    torch.cuda.empty_cache()


def random_prompts(num: int, length: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(100, 30000, length).tolist()} for _ in range(num)]


def timed_generate(llm: LLM, prompts, params) -> tuple[list, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return outputs, time.perf_counter() - start


def section_correct() -> None:
    tests = ["tests/e2e/test_spec_decode.py", "tests/unit/test_rejection_sampler.py",
             "tests/unit/test_ngram_proposer.py", "tests/unit/test_scheduler_properties.py",
             "tests/e2e/test_structured_outputs.py"]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT,
                            capture_output=True, text=True)
    print(result.stdout[-3000:], result.stderr[-2000:])
    note("spec tests on GPU", result.stdout.strip().splitlines()[-1] if result.stdout else f"rc {result.returncode}")


def section_oracle(ks: tuple[int, ...] = (2, 4), num_runs: int = 3) -> None:
    prompts = random_prompts(1, 128, seed=1)
    params = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)
    llm = make_llm()
    timed_generate(llm, prompts, params)  # warm-up
    plain_times = []
    for _ in range(num_runs):
        outputs, seconds = timed_generate(llm, prompts, params)
        plain_times.append(seconds)
    reference = outputs[0].prompt_token_ids + outputs[0].outputs[0].token_ids
    del llm
    release()
    plain = float(np.median(plain_times))
    note("oracle: plain batch 1", f"{512 / plain:.1f} tok/s ({plain * 1e3 / 512:.3f} ms/token)")
    for k in ks:
        llm = make_llm(speculative_config={**NGRAM, "num_speculative_tokens": k})
        llm.engine.core.executor.driver_worker.model_runner.speculative.proposer = OracleProposer([reference])
        scheduler = llm.engine.core.scheduler
        cost = scheduler.draft_budget.cost
        spec_times, kept = [], []
        for _ in range(num_runs + 1):  # the first run warms up
            # A fresh budget each run: its pause state would otherwise carry over from the last run.
            scheduler.draft_budget = DraftBudget(k, cost, None, llm.engine.core.executor.max_verify_tokens)
            outputs, seconds = timed_generate(llm, prompts, params)
            spec_times.append(seconds)
            got = outputs[0].outputs[0].token_ids
            kept.append(next((i for i, (x, y) in enumerate(zip(got, reference[128:])) if x != y), len(got)))
        stats = llm.engine.last_stats.spec_decoding
        spec = float(np.median(spec_times[1:]))
        note(f"oracle: k={k} batch 1",
             f"{512 / spec:.1f} tok/s = {plain / spec:.2f}x plain; acceptance length "
             f"{stats.mean_acceptance_length:.2f}; "
             f"tokens equal to plain decoding's before the first difference: {kept[1:]} of 512; step cost "
             f"{cost.fixed_s * 1e3:.2f} ms + {cost.per_token_s * 1e6:.1f} us/token")
        del llm
        release()


def section_load() -> None:
    for batch, output_len in ((64, 256), (256, 256)):
        prompts = random_prompts(batch, 128, seed=batch)
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        seconds = {}
        for name, extra in (("plain", {}), ("ngram", {"speculative_config": NGRAM})):
            llm = make_llm(**extra)
            timed_generate(llm, prompts[: min(batch, 16)], SamplingParams(temperature=0, max_tokens=16))  # warm-up
            runs = [timed_generate(llm, prompts, params)[1] for _ in range(2)]
            seconds[name] = min(runs)
            stats = llm.engine.last_stats.spec_decoding
            if stats is not None:
                note(f"load: batch {batch} ngram drafts", f"{stats.num_draft_tokens} draft tokens, acceptance "
                     f"{stats.acceptance_rate:.2f}")
            del llm
            release()
        tokens = batch * output_len
        note(f"load: batch {batch}", f"plain {tokens / seconds['plain']:.0f} out tok/s, ngram configured "
             f"{tokens / seconds['ngram']:.0f} ({seconds['plain'] / seconds['ngram']:.3f}x)")


def section_workload(name: str) -> None:
    import gpu_check

    base = [sys.executable, "-m", *gpu_check.WORKLOADS[name]]
    figures = {}
    for label, extra in (("plain", []), ("ngram", ["--speculative-config", json.dumps(NGRAM)])):
        result = subprocess.run([*base, *extra], cwd=ROOT, capture_output=True, text=True, timeout=280)
        line = next((x for x in result.stdout.splitlines() if x.startswith("Throughput")), None)
        spec_line = next((x for x in result.stdout.splitlines() if "acceptance" in x.lower()), "")
        print(f"{name} {label}: {line} {spec_line}", result.stderr[-1500:] if line is None else "")
        if line is not None:
            figures[label] = float(line.split(",")[1].split()[0])  # total tokens/s
    if len(figures) == 2:
        note(f"{name} total tok/s", f"plain {figures['plain']:.0f}, ngram configured {figures['ngram']:.0f} "
             f"({figures['ngram'] / figures['plain']:.3f}x)")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", default="correct,oracle,load")
    parser.add_argument("--out", default=None)
    parser.add_argument("--oracle-k", default="2,4", help="draft lengths the oracle section measures")
    args = parser.parse_args()
    for name in args.sections.split(","):
        if name in ("W3", "W4"):
            section_workload(name)
        elif name == "oracle":
            section_oracle(tuple(int(k) for k in args.oracle_k.split(",")))
        else:
            {"correct": section_correct, "oracle": section_oracle, "load": section_load}[name]()
    print("\n| measurement | result |\n|---|---|")
    for name, value in RESULTS.items():
        print(f"| {name} | {value} |")
    if args.out:
        Path(args.out, "spec_decode.json").write_text(json.dumps(RESULTS, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
