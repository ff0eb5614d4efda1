"""Prefix caching through the whole engine on a tiny random Llama: fewer computed tokens, same output."""


from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def make_llm(tiny, **kwargs):
    return LLM(tiny.path, skip_tokenizer_init=True, kv_cache_space=0.01, block_size=16, **kwargs)


def generate(llm, prompt, **kwargs):
    return llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False, **kwargs)[0]


def test_shared_prefix_is_computed_once_and_outputs_are_identical(tiny_llama):
    shared = [(7 * i) % 250 + 1 for i in range(40)]
    first, second = shared + [3, 4, 5], shared + [9, 8]
    uncached = make_llm(tiny_llama, enable_prefix_caching=False)
    expected = [generate(uncached, p).outputs[0].token_ids for p in (first, second)]

    llm = make_llm(tiny_llama)
    out1 = generate(llm, first)
    out2 = generate(llm, second)
    assert out1.num_cached_tokens == 0
    assert out2.num_cached_tokens == 32  # the two full 16-token blocks of the shared prefix
    stats = llm.engine.last_stats
    assert stats.prefix_cache_hits == 32
    assert stats.prefix_cache_queries == len(first) + len(second)
    assert stats.prefix_cache_requests == 2
    assert [out1.outputs[0].token_ids, out2.outputs[0].token_ids] == expected


def test_cache_salt_isolates_prefixes(tiny_llama):
    prompt = list(range(1, 50))
    llm = make_llm(tiny_llama)
    generate(llm, prompt, cache_salt="tenant-a")
    assert generate(llm, prompt, cache_salt="tenant-b").num_cached_tokens == 0
    assert generate(llm, prompt).num_cached_tokens == 0
    hit = generate(llm, prompt, cache_salt="tenant-a")
    assert hit.num_cached_tokens == 48


def test_batch_with_common_prefix_shares_blocks_within_one_step(tiny_llama):
    prefix = list(range(100, 132))
    prompts = [{"prompt_token_ids": prefix + [i, i + 1]} for i in range(1, 5)]
    uncached = make_llm(tiny_llama, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in uncached.generate(prompts, GREEDY, use_tqdm=False)]
    llm = make_llm(tiny_llama)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.last_stats.prefix_cache_hits == 3 * 32
