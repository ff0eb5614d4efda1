"""n > 1: the samples after the first fork off its prompt KV (shared full blocks, a copied partial block)
instead of computing the prompt again; each still gives the tokens it would give alone."""

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.protocol import EngineRequest

PROMPT = list(range(20, 57))  # 37 tokens: two full blocks of 16 and a partial one
BLOCK = 16


@pytest.fixture(params=[False, True], ids=["no-prefix-cache", "prefix-cache"])
def llm(tiny_llama, request):
    return LLM(tiny_llama.path, skip_tokenizer_init=True, kv_cache_space=0.01, max_model_len=128,
               enable_prefix_caching=request.param)


def scheduled_tokens(llm) -> list[dict[str, int]]:
    """Record what every schedule() hands the worker."""
    scheduler, record = llm.engine.core.scheduler, []
    schedule = scheduler.schedule

    def recording():
        output = schedule()
        record.append(dict(output.num_scheduled_tokens))
        return output

    scheduler.schedule = recording
    return record


def tokens_alone(llm, params, n):
    return [llm.generate({"prompt_token_ids": PROMPT}, params.clone_for_sample(i), use_tqdm=False)[0]
            .outputs[0].token_ids for i in range(n)]


@pytest.mark.parametrize("prompt_len", [37, 33], ids=["partial-block-copied", "full-blocks-only"])
def test_samples_share_the_prompt_and_keep_their_own_tokens(llm, prompt_len):
    prompt = PROMPT[:prompt_len]
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    reference = [llm.generate({"prompt_token_ids": prompt}, params.clone_for_sample(i), use_tqdm=False)[0]
                 .outputs[0].token_ids for i in range(4)]
    llm.engine.core.scheduler.kv.reset_prefix_cache()
    record = scheduled_tokens(llm)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == reference
    # The prompt is computed once; each other sample computes only its last prompt token.
    prompt_work = sum(n for step in record for n in step.values() if n > 1)
    assert prompt_work == prompt_len
    assert sum(1 for step in record for rid, n in step.items() if n == 1 and not rid.startswith("0_")) >= 3
    kv = llm.engine.core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_forked_samples_hold_shared_blocks_once(tiny_llama):
    llm = LLM(tiny_llama.path, skip_tokenizer_init=True, kv_cache_space=0.01, max_model_len=128,
              enable_prefix_caching=False)
    engine, kv = llm.engine, llm.engine.core.scheduler.kv
    engine.add_request("r", {"prompt_token_ids": PROMPT}, SamplingParams(n=4, temperature=1.0, max_tokens=20,
                                                                          ignore_eos=True))
    for _ in range(3):
        engine.step()  # leader's prompt, then the three followers' last prompt token, then decodes
    # Leader: 3 blocks (37 tokens); each follower: the 2 shared full blocks + its own copy of the third.
    assert kv.pool.num_blocks - kv.pool.num_free_blocks == 3 + 3
    assert [b.ref_count for b in kv.req_to_blocks["0_r"]] == [4, 4, 1]
    engine.abort_request(["r"])
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_followers_outlive_an_aborted_leader(tiny_llama):
    llm = LLM(tiny_llama.path, skip_tokenizer_init=True, kv_cache_space=0.01, max_model_len=128,
              max_num_batched_tokens=16, enable_prefix_caching=False)
    core = llm.engine.core
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    greedy = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0].token_ids
    core.add_request(EngineRequest("leader", PROMPT, params))
    for name in ("a", "b"):
        core.add_request(EngineRequest(name, PROMPT, params, fork_of="leader"))
    core.step()  # the leader's first chunk: the followers still wait for its prompt
    assert core.scheduler.forks.followers
    core.abort_requests(["leader"])  # its followers must now compute the prompt themselves
    tokens = {"a": [], "b": []}
    while core.has_requests():
        for out in core.step().outputs:
            tokens[out.request_id] += out.new_token_ids
    assert tokens == {"a": greedy, "b": greedy}
    kv = core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_blocks and not core.scheduler.forks.followers
