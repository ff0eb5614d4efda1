"""thinking_token_budget on the real default model (issue 18's reasoning): after the budget's tokens inside a
reasoning block the engine forces the end marker, token by token, and the model goes on from there; exactly so
under async scheduling, chunked prefill, preemption, n > 1, prefix caching and speculative decoding beside it.

SmolLM2 does not think in tags, so the prompts open the block themselves, as DeepSeek-R1's chat template does
("...\\n<think>"); the reference for a budget b is the greedy output without a budget: its first b tokens, the end
marker, then what greedy decoding writes after the prompt extended by those (an engine computes it, no budget).
"""

import json
from pathlib import Path

import jsonschema
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams

MARKERS = {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}
PROMPTS = ["Question: what is 2+2?\n<think>", "Write a haiku about rain.\n<think>",
           "Name three colors of the rainbow.\n<think>", "Why is the sky blue?\n<think>"]
MAX_TOKENS = 24
ENGINE = dict(max_model_len=256, dtype="float32", reasoning_config=MARKERS)


def greedy(llm: LLM, prompts, **params) -> list[list[int]]:
    sampling = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **params)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sampling, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(smollm2_path):
    return LLM(smollm2_path, kv_cache_space=0.05, async_scheduling=False, gguf_dequantize=True, **ENGINE)


@pytest.fixture(scope="module")
def end_ids(plain) -> list[int]:
    return plain.get_tokenizer().encode("</think>", add_special_tokens=False)


def reference(llm: LLM, prompts: list[str], end_ids: list[int]) -> dict[int | None, list[list[int]]]:
    """Budget -> each prompt's greedy output under it, built from budget-free runs of `llm`."""
    tokenizer = llm.get_tokenizer()
    free = greedy(llm, prompts)
    # Budget-free runs never write the end marker early (the reference's premise).
    assert all(not any(f[i:i + len(end_ids)] == end_ids for i in range(8)) for f in free), free
    out = {None: free}
    start_ids = tokenizer.encode("<think>", add_special_tokens=False)
    for budget in (0, 3, 7):
        heads = [f[:budget] + end_ids for f in free]
        extended = [{"prompt_token_ids": tokenizer.encode(p) + head} for p, head in zip(prompts, heads)]
        tails = greedy(llm, extended)
        for tail in tails:  # a block opened again would have its end forced at once: not this reference's case
            assert not any(tail[i:i + len(start_ids)] == start_ids for i in range(len(tail))), tail
        out[budget] = [(head + tail)[:MAX_TOKENS] for head, tail in zip(heads, tails)]
    return out


@pytest.fixture(scope="module")
def expected(plain, end_ids) -> dict[int | None, list[list[int]]]:
    return reference(plain, PROMPTS, end_ids)


def check_budgets(llm: LLM, expected: dict[int | None, list[list[int]]]) -> None:
    for budget in (0, 3, 7):
        assert greedy(llm, PROMPTS, thinking_token_budget=budget) == expected[budget], budget
    # A budget larger than the output changes nothing.
    assert greedy(llm, PROMPTS, thinking_token_budget=100) == expected[None]


def test_the_end_marker_is_forced_after_the_budget(plain, expected):
    check_budgets(plain, expected)


def test_budgets_mixed_in_one_batch_with_rows_without(plain, expected):
    budgets = [3, None, 0, 7]
    outs = plain.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, thinking_token_budget=b)
                                    for b in budgets], use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [expected[b][i] for i, b in enumerate(budgets)]


def test_async_scheduling_chunked_prefill_preemption_and_n(smollm2_path, expected, end_ids):
    """Async scheduling, 16-token prefill chunks and a pool so small that requests get preempted (and resume with
    their machine rebuilt from their output), each prompt twice (prefix caching) and n=2 (the second sample forked
    from the first's prompt)."""
    llm = LLM(smollm2_path, num_gpu_blocks_override=17, max_num_batched_tokens=16, async_scheduling=True,
              enable_prefix_caching=True, gguf_dequantize=True, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, thinking_token_budget=3, n=2)
    outs = llm.generate(PROMPTS * 2, params, use_tqdm=False)
    for i, out in enumerate(outs):
        assert [list(c.token_ids) for c in out.outputs] == [expected[3][i % len(PROMPTS)]] * 2, i
    assert llm.engine.last_stats.num_preemptions > 0
    # Sampled rows: the budget's tokens, then the end marker, whatever was drawn before it.
    sampled = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=7, max_tokens=12, thinking_token_budget=5,
                                                   n=3), use_tqdm=False)
    for out in sampled:
        assert all(list(c.token_ids)[5:8] == end_ids for c in out.outputs), out


def test_budget_rows_decode_beside_drafting_ones(smollm2_path, expected, unmeasured_step_cost):
    """Speculative decoding: rows with a budget take one token a step (can_draft); the others draft and verify
    beside them, each row's tokens those of plain decoding."""
    llm = LLM(smollm2_path, kv_cache_space=0.05, gguf_dequantize=True, **ENGINE,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    budget = llm.engine.core.scheduler.draft_budget
    budget.cost, budget.min_gain = None, 0.0  # draft every step, whatever the measured step cost says
    copy = "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,"  # continued by repeating: drafts that stand
    outs = llm.generate([*PROMPTS, copy], [SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                          thinking_token_budget=3)] * 4
                        + [SamplingParams(temperature=0, max_tokens=MAX_TOKENS)], use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs[:4]] == expected[3]
    assert llm.engine.last_stats.spec_decoding.num_accepted_tokens > 0


def test_a_structure_after_the_reasoning_follows_the_forced_end(plain, end_ids):
    """Structured outputs that start after the reasoning (reasoning_end, as the server's --reasoning-parser sets):
    the forced end marker lets the structure begin."""
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    spec = StructuredOutputsParams(json=schema, reasoning_end="</think>")
    [out] = plain.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40, thinking_token_budget=4,
                                                        structured_outputs=spec), use_tqdm=False)
    ids = list(out.outputs[0].token_ids)
    assert ids[4:4 + len(end_ids)] == end_ids and out.outputs[0].finish_reason == "stop", out.outputs[0]
    answer = out.outputs[0].text.split("</think>", 1)[1]
    jsonschema.validate(json.loads(answer), schema)


def test_a_budget_needs_the_engines_markers(smollm2_llm):
    with pytest.raises(ValueError, match="thinking_token_budget needs the reasoning block's markers"):
        smollm2_llm.generate(["Hi"], SamplingParams(thinking_token_budget=4), use_tqdm=False)


@pytest.mark.gpu
def test_the_gpus_kernels_under_cuda_graphs_and_async_scheduling(tmp_path):
    """On a GPU the machine steps in Triton kernels (kernels/thinking_budget.py), beside the decode CUDA graphs and
    async scheduling (on by default there): a 2-layer Qwen3 with dummy weights and the repo's SmolLM2 tokenizer,
    in float32, against its own budget-free runs."""
    root = Path(__file__).resolve().parents[2] / "benchmarks/models"
    config = json.loads((root / "qwen3-0.6b/config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_window_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), load_format="dummy", tokenizer=str(root / "smollm2-tokenizer"), **ENGINE)
    assert llm.engine.core.executor.driver_worker.model_runner.cuda_graphs is not None
    end_ids = llm.get_tokenizer().encode("</think>", add_special_tokens=False)
    check_budgets(llm, reference(llm, PROMPTS, end_ids))
