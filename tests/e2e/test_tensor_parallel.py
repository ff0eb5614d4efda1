"""Tensor parallelism on the CPU (gloo): two ranks, each in its own process, against one.

Tiny seeded random Llamas in float32: kv heads split over the ranks (2 kv heads), and replicated (1 kv
head for 2 ranks), with a vocabulary the ranks split unevenly (a padded last shard). The two-rank engine
runs with async scheduling, chunked prefill, prefix caching and ngram speculative decoding all on, and
must give the one-rank engine's greedy tokens (logprobs within float32 reduction-order noise). Random
sampling is checked against transformers: every sampled token's logprob, in the context of the tokens
reported so far, must be the model's, which fails if the ranks ever sampled different tokens (their
next steps would mix two different histories).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tokenmill import LLM, SamplingParams

MODELS = {
    "kv-split": dict(num_key_value_heads=2, vocab_size=301, tie_word_embeddings=False),
    "kv-replicated": dict(num_key_value_heads=1, vocab_size=256, tie_word_embeddings=True),
}
ENGINE = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=128, num_gpu_blocks_override=64)
TP_ENGINE = dict(ENGINE, tensor_parallel_size=2, async_scheduling=True, max_num_batched_tokens=24,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
LOGPROB_ATOL = 1e-4
"""float32 all-reduces sum partial products in another order than one rank's matmul: ~1e-6 relative."""


def build_model(folder, overrides: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                         initializer_range=0.2,  # peaked logits: no greedy step is a near tie
                         **overrides)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


def prompts() -> list[dict]:
    shared = [(5 * j) % 200 + 3 for j in range(20)]  # a prefix long enough to hit the prefix cache
    repeating = [{"prompt_token_ids": [9, 40, 41, 42, 43] * 6}]  # ngram lookups find a match: drafts
    return [{"prompt_token_ids": shared + [(7 * i + j) % 250 + 3 for j in range(3 + 5 * i)]}
            for i in range(4)] + repeating


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module", params=list(MODELS))
def case(request, tmp_path_factory):
    """(HF model, one-rank greedy outputs, the two-rank engine); the reference is made before the two-rank
    engine exists, since a process's layers take their shard from its group."""
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = build_model(folder, MODELS[request.param])
    reference = LLM(str(folder), **ENGINE).generate(prompts(), GREEDY, use_tqdm=False)
    llm = LLM(str(folder), **TP_ENGINE)
    yield hf_model, reference, llm
    llm.engine.core.shutdown()


def record_stats_and_always_draft(core, monkeypatch) -> list:
    """The engine's scheduler stats, step by step, in the returned list; and drafts whenever the proposer finds
    some (the CPU's measured step cost would rather not draft)."""
    stats, step = [], core.step

    def recording_step():
        outputs = step()
        if outputs.scheduler_stats is not None:
            stats.append(outputs.scheduler_stats)
        return outputs

    monkeypatch.setattr(core, "step", recording_step)
    monkeypatch.setattr(core.scheduler.draft_budget, "cost", None)
    monkeypatch.setattr(core.scheduler.draft_budget, "min_gain", 0.0)
    return stats


def test_two_ranks_give_the_one_rank_greedy_tokens(case, monkeypatch):
    _, reference, llm = case
    core = llm.engine.core
    assert core.executor.world_size == 2 and core.async_scheduling
    stats = record_stats_and_always_draft(core, monkeypatch)
    actual = llm.generate(prompts(), GREEDY, use_tqdm=False)
    # The features composed with TP did run: prefix-cache hits, drafts verified.
    assert sum(s.prefix_cache_hits for s in stats) > 0
    assert stats[-1].spec_decoding.num_draft_tokens > 0
    for want, got in zip(reference, actual):
        want, got = want.outputs[0], got.outputs[0]
        assert got.token_ids == want.token_ids
        for w, g in zip(want.logprobs, got.logprobs):
            (token,) = w  # logprobs=0: the sampled token only
            assert g[token].logprob == pytest.approx(w[token].logprob, abs=LOGPROB_ATOL)
    kv = llm.engine.core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_sampled_tokens_agree_across_ranks(case):
    hf_model, _, llm = case
    params = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=10, ignore_eos=True, logprobs=0)]
    batch = prompts()[:2]
    outputs = llm.generate(batch, params, use_tqdm=False)
    for prompt, output in zip(batch, outputs):
        sample = output.outputs[0]
        ids = torch.tensor([prompt["prompt_token_ids"] + list(sample.token_ids)])
        with torch.no_grad():
            logprobs = hf_model(ids).logits[0].float().log_softmax(-1)
        start = len(prompt["prompt_token_ids"]) - 1
        for i, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
            assert entry[token].logprob == pytest.approx(logprobs[start + i, token].item(), abs=LOGPROB_ATOL)
    # Seeded: the same tokens again on the same layout.
    again = llm.generate(batch[1:], params[1:], use_tqdm=False)
    assert again[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_an_eagle_head_drafts_under_tensor_parallelism_and_keeps_the_greedy_tokens(tmp_path, monkeypatch):
    """speculative_config eagle under TP = 2: the head's layer shards as the target's do, `fc` reads the
    target's (all-reduced, whole) hidden states, the LM head is the target's vocab-parallel one; the head is
    built from the target's own layer, so its drafts are mostly accepted."""
    from tests.e2e.test_spec_decode import write_eagle_target_and_head

    target, head = tmp_path / "target", tmp_path / "head"
    head.mkdir()
    write_eagle_target_and_head(target, head)
    batch = [{"prompt_token_ids": [t % 250 + 3 for t in p["prompt_token_ids"]]} for p in prompts()]  # vocab 256
    reference = LLM(str(target), **ENGINE).generate(batch, GREEDY, use_tqdm=False)
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 3}
    llm = LLM(str(target), **dict(TP_ENGINE, speculative_config=spec))
    try:
        stats = record_stats_and_always_draft(llm.engine.core, monkeypatch)
        actual = llm.generate(batch, GREEDY, use_tqdm=False)
        assert stats[-1].spec_decoding.num_accepted_tokens > 0
    finally:
        llm.engine.core.shutdown()
    assert [o.outputs[0].token_ids for o in actual] == [o.outputs[0].token_ids for o in reference]


def test_a_draft_model_shards_over_the_ranks_and_keeps_the_greedy_tokens(tmp_path, monkeypatch):
    """speculative_config draft_model under TP = 2: the draft (1 layer, its own weights) is sharded as the target
    is, its KV in the same pool; drafts are verified (mostly rejected: an unrelated random model) and the tokens
    are the one-rank engine's without speculation."""
    build_model(tmp_path / "target", MODELS["kv-split"])
    torch.manual_seed(1)
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=301, max_position_embeddings=256,
                                 tie_word_embeddings=False)).save_pretrained(tmp_path / "draft")
    reference = LLM(str(tmp_path / "target"), **ENGINE).generate(prompts(), GREEDY, use_tqdm=False)
    spec = {"method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3}
    llm = LLM(str(tmp_path / "target"), **dict(TP_ENGINE, speculative_config=spec))
    try:
        stats = record_stats_and_always_draft(llm.engine.core, monkeypatch)
        actual = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert stats[-1].spec_decoding.num_draft_tokens > 0
    finally:
        llm.engine.core.shutdown()
    assert [o.outputs[0].token_ids for o in actual] == [o.outputs[0].token_ids for o in reference]


def test_parallel_config_is_checked():
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM("unused", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        LLM("unused", tensor_parallel_size=2, distributed_executor_backend="uni")


def test_a_dead_rank_ends_the_engine_with_a_clear_error(tmp_path):
    build_model(tmp_path, MODELS["kv-split"])
    llm = LLM(str(tmp_path), **ENGINE, tensor_parallel_size=2)
    executor = llm.engine.core.executor
    (child,) = executor._procs.values()
    try:
        os.kill(child.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 .* exited with code -9"):
            llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 10
    finally:
        llm.engine.core.shutdown()
    assert child.poll() is not None


def test_shutdown_leaves_no_rank_running(case):
    # Last in the module for each model: it stops the shared engine (the fixture's shutdown is then a no-op).
    _, _, llm = case
    children = list(llm.engine.core.executor._procs.values())
    llm.engine.core.shutdown()
    assert all(child.poll() is not None for child in children)
    from tokenmill.distributed.parallel_state import get_tp_size

    assert get_tp_size() == 1  # the group is gone: a one-rank engine may start in this process again


def test_ranks_exit_when_the_engine_process_is_killed(tmp_path):
    """SIGKILL leaves the executor no chance to stop its ranks: they notice the orphaning themselves."""
    build_model(tmp_path, MODELS["kv-split"])
    script = (f"from tokenmill import LLM\n"
              f"llm = LLM({str(tmp_path)!r}, tensor_parallel_size=2, **{ENGINE!r})\n"
              f"print(*(p.pid for p in llm.engine.core.executor._procs.values()), flush=True)\n"
              f"import time; time.sleep(600)\n")
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in engine.stdout.readline().split()]
        assert pids, "the engine did not start"
    finally:
        engine.kill()
        engine.wait()
    deadline = time.monotonic() + 10
    while any(map(is_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(is_running, pids))


def test_sigterm_stops_an_offline_command_and_its_ranks(tiny_llama, tmp_path):
    """`tokenmill bench latency -tp 2` (any offline command) stopped by SIGTERM: it used to die at once, leaving
    its ranks to notice the orphaning and the ranks' socket folder behind in the temp folder."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    command = [sys.executable, "-m", "tokenmill.cli", "bench", "latency", "--model", tiny_llama.path,
               "--skip-tokenizer-init", "-tp", "2", "--input-len", "8", "--output-len", "200", "--num-iters", "1000"]
    bench = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                             env={**os.environ, "TMPDIR": str(temp)})
    try:
        for line in bench.stderr:  # generating once the ranks are up
            if "ranks ready" in line:
                break
        ranks = [int(name) for name in os.listdir("/proc") if name.isdigit() and _parent(int(name)) == bench.pid]
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        bench.kill()
    assert ranks and not any(map(is_running, ranks))  # the executor waits for its ranks as it stops
    assert list(temp.iterdir()) == []


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_heads_the_ranks_cannot_split_are_refused():
    from transformers import LlamaConfig

    from tokenmill.executor.base import check_tensor_parallel

    config = LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=192)
    check_tensor_parallel(config, 3)
    with pytest.raises(ValueError, match="does not divide the model's 6 attention heads"):
        check_tensor_parallel(config, 4)
    with pytest.raises(ValueError, match="key-value heads must divide one another"):
        check_tensor_parallel(config, 2)


def test_grammar_compiler_travels_as_its_recipe():
    import functools
    import pickle

    from tokenmill.structured.compiler import GrammarCompiler

    compiler = GrammarCompiler(functools.partial(dict, a=1), 128, num_threads=1)
    copy = pickle.loads(pickle.dumps(compiler))
    assert copy is not compiler and copy._vocab_size == 128 and copy._load_tokenizer() == {"a": 1}
    compiler.shutdown()
    copy.shutdown()
