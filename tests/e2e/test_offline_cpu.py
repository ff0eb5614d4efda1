"""The offline engine on the CPU: the thread count it computes with, and its progress bar."""

import os
import subprocess
import sys

import pytest

CHILD = """
import sys, torch
from tokenmill import LLM, SamplingParams
llm = LLM(sys.argv[1], skip_tokenizer_init=True, kv_cache_space=0.01, max_model_len=64)
llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=True)
print("threads", torch.get_num_threads())
"""


def run_child(model: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | env
    return subprocess.run([sys.executable, "-c", CHILD, model], capture_output=True, text=True, env=environment,
                          timeout=120)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_offline_cpu_chooses_its_threads_unless_the_user_chose(tiny_llama):
    num_cpus = len(os.sched_getaffinity(0))
    chosen = run_child(tiny_llama.path)
    # All cores or one fewer, step by step, by what else runs (worker.cpu_threads; tests/unit/test_cpu_threads.py).
    assert f"threads {num_cpus - 1}\n" in chosen.stdout or f"threads {num_cpus}\n" in chosen.stdout, \
        chosen.stderr[-2000:]
    # The progress bar reports throughput as vLLM's does.
    assert "est. speed input:" in chosen.stderr and "toks/s, output:" in chosen.stderr
    assert "threads 1\n" in run_child(tiny_llama.path, OMP_NUM_THREADS="1").stdout
