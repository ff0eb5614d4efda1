"""The offline engine on the CPU: the thread count it computes with, its progress bar, and the sampling defaults
of generation_config.json."""

import json
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


def test_generation_config_gives_the_defaults_of_calls_without_sampling_params(tiny_llama, tmp_path):
    """As vLLM's LLM: generate() (and chat(), through it) without sampling_params samples with
    get_default_sampling_params(), the file's values with the override on top; sampling_params given are used as
    they are (max_new_tokens limits only the defaults)."""
    from tokenmill import LLM, SamplingParams

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "top_p": 0.9, "max_new_tokens": 3, "do_sample": True}))
    with pytest.raises(ValueError, match="no generation_config.json in"):
        LLM(tiny_llama.path, generation_config=str(tmp_path / "missing"))
    # hf_overrides too (one engine start for both): vLLM's keys set on the HF config the workers build from.
    llm = LLM(tiny_llama.path, skip_tokenizer_init=True, kv_cache_space=0.01, max_model_len=64,
              generation_config=str(tmp_path), override_generation_config={"top_k": 7, "top_p": None},
              hf_overrides={"rms_norm_eps": 0.5})
    defaults = llm.get_default_sampling_params()
    assert defaults == SamplingParams(temperature=0.0, top_k=7, max_tokens=3)
    # Those set, apart: the offline CLIs put the flags given over them (tests/unit/test_cli.py).
    assert llm.sampling_defaults == {"temperature": 0.0, "top_k": 7, "max_tokens": 3}
    defaults.max_tokens = 1  # the caller's own copy
    assert llm.get_default_sampling_params().max_tokens == 3
    prompt = {"prompt_token_ids": [1, 2, 3]}
    [by_default] = llm.generate(prompt, use_tqdm=False)
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(greedy[0].outputs[0].token_ids) == 5
    assert by_default.outputs[0].token_ids == greedy[0].outputs[0].token_ids[:3]
    assert greedy[0].outputs[0].token_ids == hf_greedy(tiny_llama.model, [1, 2, 3], 5, rms_norm_eps=0.5)
    assert greedy[0].outputs[0].token_ids != hf_greedy(tiny_llama.model, [1, 2, 3], 5)  # the override mattered


def hf_greedy(model, prompt: list[int], max_tokens: int, **overrides) -> list[int]:
    """transformers' greedy tokens of `model` with `overrides` set on a copy of its config."""
    import copy

    import torch

    config = copy.deepcopy(model.config)
    for key, value in overrides.items():
        setattr(config, key, value)
    other = type(model)(config).eval()
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        out = other.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
