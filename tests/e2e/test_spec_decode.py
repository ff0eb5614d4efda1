"""Speculative decoding through the whole engine: emitted tokens and logprobs equal plain decoding's.

The n-gram proposer rarely finds long runs in a random model's output, so most tests here swap in a
scripted proposer that knows the plain run's continuation and drafts it with mistakes at known places:
every mechanism (long accepted runs, rejections at each position, stops inside a run) is then exercised
on purpose, in every engine mode (async on and off, chunked prefill, preemption, prefix caching, n > 1).
"""

from __future__ import annotations

import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig

SPEC = {"method": "ngram", "num_speculative_tokens": 4}
ENGINES = {
    "default": dict(kv_cache_space=0.01),
    "async": dict(kv_cache_space=0.01, async_scheduling=True),
    "chunked-prefill": dict(kv_cache_space=0.01, max_num_batched_tokens=16, async_scheduling=True),
    # 8 blocks: preemptions with and without async scheduling (the GPU's default), EAGLE's slots ahead included.
    "preempting": dict(num_gpu_blocks_override=8, max_num_batched_tokens=64),
    "no-prefix-caching": dict(kv_cache_space=0.01, enable_prefix_caching=False),
}


class ScriptedProposer:
    """Drafts the known continuation of each sequence, wrong at about one draft in four (a deterministic
    choice per position), and nothing at about one step in six."""

    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences = sequences
        self.num_proposed = 0

    def continuation(self, tokens: list[int]) -> list[int]:
        for sequence in self.sequences:
            if sequence[: len(tokens)] == tokens:
                return sequence[len(tokens):]
        return []

    def propose(self, states, rows: np.ndarray, max_drafts: np.ndarray) -> list[np.ndarray]:
        drafts = []
        for row, k in zip(rows.tolist(), max_drafts.tolist()):
            tokens = states.token_ids[row, : states.num_tokens[row]].tolist()
            key = zlib.crc32(str(tokens).encode())
            draft = self.continuation(tokens)[:k] if key % 6 else []
            draft = [t if zlib.crc32(f"{key}:{i}".encode()) % 4 else (t + 1) % 200 for i, t in enumerate(draft)]
            self.num_proposed += len(draft)
            drafts.append(np.array(draft, dtype=np.int64))
        return drafts


def use_scripted_proposer(llm: LLM, proposer: ScriptedProposer) -> None:
    llm.engine.core.executor.driver_worker.model_runner.speculative.proposer = proposer
    always_draft(llm)


def always_draft(llm: LLM) -> None:
    """The full lookahead every step (the measured step cost would often choose fewer, and steps that gain
    little pause drafting): every depth and every rejection is tested."""
    budget = llm.engine.core.scheduler.draft_budget
    budget.cost, budget.min_gain = None, 0.0


def skip_step_cost_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process engines built after this start without timing their steps for the draft budget (~1.3 s on the
    default model, float32, on a small CPU): for those the test then makes draft every step (always_draft), which
    throws the measured cost away."""
    monkeypatch.setattr("tokenmill.worker.step_cost.measure_step_cost", lambda worker, max_tokens: None)


def workload():
    shared = [(5 * j) % 200 + 1 for j in range(20)]  # a common prefix: prefix-cache hits
    prompts = [{"prompt_token_ids": shared + [(7 * i + 3 * j) % 200 + 1 for j in range(3 + 7 * i)]} for i in range(6)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True, min_tokens=9),
        SamplingParams(temperature=0.0, max_tokens=26, ignore_eos=True, n=2),
        SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True, presence_penalty=0.5),  # never drafted
    ]
    return prompts, params


def run(tiny_llama, engine: dict, spec: dict | None = None, proposer_sequences=None):
    llm = LLM(tiny_llama.path, skip_tokenizer_init=True, max_model_len=128, dtype="float32", **engine,
              **({"speculative_config": spec} if spec else {}))
    proposer = None
    if proposer_sequences is not None:
        use_scripted_proposer(llm, proposer := ScriptedProposer(proposer_sequences))
    prompts, params = workload()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert not llm.engine.core.has_requests()
    kv = llm.engine.core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_blocks, "blocks leaked"
    return outputs, llm, proposer


@pytest.fixture(scope="module")
def plain(tiny_llama):
    outputs, _, _ = run(tiny_llama, ENGINES["default"])
    return outputs


SHORT_PROMPTS = [{"prompt_token_ids": [5, 9, 13, 17, 21, 30][: 3 + i]} for i in range(3)]


def tokens_drafts_and_acceptances(llm: LLM) -> tuple[list[list[int]], int, int]:
    """Greedy tokens of SHORT_PROMPTS (10 each), draft tokens verified and accepted; the engine shut down after."""
    try:
        outputs = llm.generate(SHORT_PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                               use_tqdm=False)
        spec = llm.engine.last_stats.spec_decoding
        return [o.outputs[0].token_ids for o in outputs], spec.num_draft_tokens, spec.num_accepted_tokens
    finally:
        llm.engine.core.shutdown()


def sequences_of(outputs) -> list[list[int]]:
    return [out.prompt_token_ids + c.token_ids for out in outputs for c in out.outputs]


@pytest.mark.parametrize("engine", list(ENGINES))
def test_drafted_runs_give_exactly_the_plain_tokens_and_logprobs(tiny_llama, plain, engine):
    outputs, llm, proposer = run(tiny_llama, ENGINES[engine], SPEC, sequences_of(plain))
    check_same_tokens_and_logprobs(outputs, plain)
    stats = llm.engine.last_stats.spec_decoding
    assert proposer.num_proposed > 0 and stats.num_draft_tokens == proposer.num_proposed
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_position[3] > 0, "no run of four accepted drafts"
    if engine == "preempting":
        assert llm.engine.last_stats.num_preemptions > 0


def test_stop_tokens_inside_an_accepted_run_end_the_request_there(tiny_llama, plain):
    # The stop token is the 6th output token of a long request: drafts run past it, emission must not.
    long_output = plain[1].outputs[0].token_ids
    stop = long_output[5]
    first = long_output.index(stop)
    llm = LLM(tiny_llama.path, skip_tokenizer_init=True, max_model_len=128, dtype="float32", kv_cache_space=0.01,
              speculative_config=SPEC)
    use_scripted_proposer(llm, ScriptedProposer(sequences_of(plain)))
    prompt = {"prompt_token_ids": plain[1].prompt_token_ids}
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == long_output[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_ngram_proposer_keeps_greedy_tokens_and_seeded_sampling_repeats_and_masks_apply_to_drafts(tiny_llama, plain):
    outputs, llm, _ = run(tiny_llama, ENGINES["async"], {**SPEC, "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    assert [c.token_ids for o in outputs for c in o.outputs] == [c.token_ids for o in plain for c in o.outputs]
    assert llm.engine.last_stats.spec_decoding.num_drafts > 0
    # A seeded request decodes without drafts: its tokens are exactly those it gets without speculation.
    prompts = [{"prompt_token_ids": [3, 3, 3, 3, 9, 3, 3, 3]}] * 2
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=40, ignore_eos=True)
    drafts_before = llm.engine.last_stats.spec_decoding.num_draft_tokens
    seeded = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.last_stats.spec_decoding.num_draft_tokens == drafts_before
    # The worker hears of the finished requests with the next step (here the seeded ones', never drafted).
    proposer = llm.engine.core.executor.driver_worker.model_runner.speculative.proposer
    assert not proposer._rows, "the n-gram index outlived its finished requests"
    plain_llm = LLM(tiny_llama.path, skip_tokenizer_init=True, max_model_len=128, dtype="float32", kv_cache_space=0.01)
    assert [o.outputs[0].token_ids for o in seeded] == [o.outputs[0].token_ids
                                                         for o in plain_llm.generate(prompts, params, use_tqdm=False)]
    # Masked logits (logit_bias, allowed_token_ids) do draft: the verification masks every draft position as the
    # sampler masks its own (the scripted drafts' mistakes fall outside the mask too).
    masked = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logit_bias={7: 1.0, 11: 1.0},
                            allowed_token_ids=list(range(1, 120)), logprobs=1)
    prompts = workload()[0][2:4]
    expected = plain_llm.generate(prompts, masked, use_tqdm=False)
    use_scripted_proposer(llm, proposer := ScriptedProposer(sequences_of(expected)))
    check_same_tokens_and_logprobs(llm.generate(prompts, masked, use_tqdm=False), expected)
    assert proposer.num_proposed > 0


@pytest.fixture(scope="module")
def other_tiny_llama(tmp_path_factory):
    """Another seeded random Llama of the same vocabulary, smaller: a draft model that is often wrong."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         eos_token_id=255, bos_token_id=1)
    path = tmp_path_factory.mktemp("draft-llama")
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_draft_model_equal_to_the_target_drafts_right_and_changes_no_token(tiny_llama, plain, engine):
    spec = {"method": "draft_model", "model": tiny_llama.path, "num_speculative_tokens": 3}
    outputs, llm, _ = run(tiny_llama, ENGINES[engine], spec)
    assert [c.token_ids for o in outputs for c in o.outputs] == [c.token_ids for o in plain for c in o.outputs]
    stats = llm.engine.last_stats.spec_decoding
    assert stats.num_drafts > 0 and stats.acceptance_rate > 0.9, stats
    if engine == "preempting":
        assert llm.engine.last_stats.num_preemptions > 0


def test_draft_model_steps_of_rows_near_max_model_len_stay_in_their_blocks(tiny_llama):
    """A request near max_model_len drafts fewer tokens than the others; its unused draft-model steps must not go
    past its own slots (an IndexError at the block table's end failed the whole step)."""
    target, spec = tiny_llama.path, {"method": "draft_model", "model": tiny_llama.path}
    prompts = [{"prompt_token_ids": [(7 * j) % 40 + 3 for j in range(n)]} for n in (30, 57, 58, 59, 60, 61, 62)]
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    engine = dict(skip_tokenizer_init=True, max_model_len=64, dtype="float32", kv_cache_space=0.01)
    plain = LLM(target, **engine).generate(prompts, params, use_tqdm=False)
    llm = LLM(target, **engine, speculative_config={**spec, "num_speculative_tokens": 4})
    always_draft(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.last_stats.spec_decoding.num_draft_tokens > 0


def test_a_different_draft_model_is_mostly_rejected_and_changes_no_token(tiny_llama, plain, other_tiny_llama):
    spec = {"method": "draft_model", "model": other_tiny_llama, "num_speculative_tokens": 2}
    outputs, llm, _ = run(tiny_llama, ENGINES["chunked-prefill"], spec)
    always_draft(llm)
    outputs = llm.generate(*workload(), use_tqdm=False)
    assert [c.token_ids for o in outputs for c in o.outputs] == [c.token_ids for o in plain for c in o.outputs]
    stats = llm.engine.last_stats.spec_decoding
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate < 0.9, stats


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_llama, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(tiny_llama.path, skip_tokenizer_init=True, speculative_config={
            "method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2})


def test_speculative_config_is_checked_at_start_up(tiny_llama):
    with pytest.raises(ValueError, match="not supported"):
        LLM(tiny_llama.path, skip_tokenizer_init=True, speculative_config={"method": "medusa",
                                                                         "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(tiny_llama.path, skip_tokenizer_init=True, speculative_config={"method": "ngram",
                                                                         "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="needs a 'model'"):
        LLM(tiny_llama.path, skip_tokenizer_init=True, speculative_config={"method": "draft_model",
                                                                         "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        LLM(tiny_llama.path, skip_tokenizer_init=True, speculative_config={"method": "ngram",
                                                                         "num_speculative_tokens": 2, "k": 1})
    with pytest.raises(ValueError, match="speculative_config model '/no/such/head' does not exist"):
        EngineConfig.from_kwargs(tiny_llama.path, speculative_config={"method": "eagle", "model": "/no/such/head",
                                                                      "num_speculative_tokens": 2})
    tree = "[(0,), (1,), (0, 0)]"  # vLLM's spelling: a string
    with pytest.raises(ValueError, match="speculative_token_tree needs the speculative method 'eagle' or 'eagle3'"):
        LLM(tiny_llama.path, skip_tokenizer_init=True, speculative_config={
            "method": "ngram", "num_speculative_tokens": 2, "speculative_token_tree": tree})
    eagle = {"method": "eagle", "model": tiny_llama.path}
    for bad, message in (("[(0,), (0, 0), (1, 0)]", r"path \(1, 0\) has no parent \(1,\)"),
                         ([[1]], r"path \(1,\) without its sibling \(0,\)"),
                         ([[0], [0]], "listed twice"), ("[(0,), (-1,)]", "child indices >= 0"),
                         ([[0]] + [[0] * i + [1] for i in range(64)], "at most 63")):
        with pytest.raises(ValueError, match=message):
            LLM(tiny_llama.path, skip_tokenizer_init=True, speculative_config={
                **eagle, "num_speculative_tokens": 1, "speculative_token_tree": bad})
    with pytest.raises(ValueError, match=r"must be the speculative_token_tree's depth \(2\) or its number of nodes"):
        LLM(tiny_llama.path, skip_tokenizer_init=True, speculative_config={
            **eagle, "num_speculative_tokens": 4, "speculative_token_tree": tree})


def test_the_priority_policy_preempting_a_request_with_drafts_unschedules_its_drafts_too(tiny_llama):
    """Under the priority policy a request already scheduled in this step (with draft slots) may be preempted
    to make room for a more urgent one: its drafts were still handed to the worker (a KeyError there)."""
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 60 + 3 for j in range(20 + 9 * i)]} for i in range(5)]
    params = SamplingParams(temperature=0.0, n=2, max_tokens=25, ignore_eos=True)
    priorities = [3, 1, 2, 0, 1]
    engine = dict(skip_tokenizer_init=True, max_model_len=128, dtype="float32")
    plain = LLM(tiny_llama.path, **engine, kv_cache_space=0.01).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_llama.path, **engine, num_gpu_blocks_override=10, max_num_batched_tokens=32, policy="priority",
              speculative_config={**SPEC, "prompt_lookup_min": 1})
    always_draft(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False, priority=priorities)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[c.token_ids for c in o.outputs] for o in plain]
    assert llm.engine.last_stats.num_preemptions > 0


def test_one_sequence_at_a_time_still_drafts(tiny_llama, plain):
    """max_num_seqs 1 (a single user's latency setting): a step verifies one request's token and its drafts (it
    once verified at most max_num_seqs tokens, so nothing was ever drafted); greedy tokens as plain decoding's."""
    outputs, llm, proposer = run(tiny_llama, dict(kv_cache_space=0.01, max_num_seqs=1), SPEC, sequences_of(plain))
    check_same_tokens_and_logprobs(outputs, plain)
    assert proposer.num_proposed > 0 and llm.engine.last_stats.spec_decoding.num_accepted_tokens > 0


def test_the_step_cost_is_measured_within_a_one_block_pool(tiny_llama):
    """The start-up timing of verify steps used two requests of a block each: past a one-block pool, its KV
    writes corrupted the heap (the process aborted, often only at exit: hence a process of its own)."""
    code = (f"from tokenmill import LLM, SamplingParams\n"
            f"llm = LLM({tiny_llama.path!r}, skip_tokenizer_init=True, dtype='float32', max_model_len=16, "
            f"num_gpu_blocks_override=1, speculative_config={SPEC!r})\n"
            f"out = llm.generate({{'prompt_token_ids': [3, 4, 3, 4, 3, 4]}}, SamplingParams(temperature=0, "
            f"max_tokens=8, ignore_eos=True), use_tqdm=False)\n"
            f"print(out[0].outputs[0].token_ids)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    plain = LLM(tiny_llama.path, skip_tokenizer_init=True, dtype="float32", max_model_len=16, kv_cache_space=0.01)
    expected = plain.generate({"prompt_token_ids": [3, 4, 3, 4, 3, 4]}, SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert done.stdout.strip().splitlines()[-1] == str(expected)


class _Model:
    def __init__(self, path: str) -> None:
        self.path = path


def write_eagle_target_and_head(target, head) -> None:
    """A seeded random 1-layer Llama whose embedding rows have RMS 1 (so its layer's input norm, weight 1, is
    the identity) into folder `target`, and into `head` an EAGLE-1 head in the published layout (config.json,
    pytorch_model.bin, `fc.weight`, `layers.0.*` without an input norm, no embedding or LM head) built from that
    very layer, with `fc` passing the token embedding and ignoring the hidden state. At position p the head then
    computes what the target computes at p + 1, one position earlier (RoPE sees only the offset), except that it
    never sees token 0; and the target's final norm (weight 1) only scales what the shared LM head reads. So its
    drafts are often, not always, the target's tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=255, bos_token_id=1, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed /= embed.pow(2).mean(dim=-1, keepdim=True).sqrt()
    model.save_pretrained(target)
    config.save_pretrained(head)
    tensors = {"fc.weight": torch.cat([torch.eye(64), torch.zeros(64, 64)], dim=1)}
    for name, tensor in model.model.layers[0].state_dict().items():
        if not name.startswith("input_layernorm."):
            tensors[f"layers.0.{name}"] = tensor.clone()
    torch.save(tensors, head / "pytorch_model.bin")


@pytest.fixture(scope="module")
def eagle_target_and_head(tmp_path_factory):
    """(target, head): see write_eagle_target_and_head."""
    target, head = tmp_path_factory.mktemp("eagle-target"), tmp_path_factory.mktemp("eagle-head")
    write_eagle_target_and_head(target, head)
    return _Model(str(target)), str(head)


def record_target_hidden_states(llm: LLM) -> list:
    """(positions, next tokens, hidden states) of every head pass that reads the target's hidden states: the
    first forward pass of each observe() and propose() (the later ones of propose() read the head's own). With
    CUDA graphs propose()'s first pass may be a graph replay (`_step`), which never reaches `_forward`: both
    are watched, so that a later pass is never taken for the first."""
    proposer = llm.engine.core.executor.driver_worker.model_runner.speculative.proposer
    records, first = [], [False]

    def recording(method):
        def recorded(layout, input_ids, positions, hidden=None, **kwargs):
            if first[0]:
                first[0] = False
                # A tree's level passes feed token ids from the device.
                records.append((np.array(positions), torch.as_tensor(input_ids).cpu().numpy(), hidden.cpu().clone()))
            return method(layout, input_ids, positions, hidden=hidden, **kwargs)
        return recorded

    def first_pass_of(method):
        def wrapped(*args, **kwargs):
            first[0] = True
            try:
                return method(*args, **kwargs)
            finally:
                first[0] = False
        return wrapped

    def recorded_after_verify(states, rows, first_positions, num_drafts, target_states, tokens, num_emitted,
                              shift=None):
        # Its first pass also reads the target's states past the accepted drafts (their KV is rewritten later):
        # only those of emitted tokens are the head's input proper. (`shift`: a step launched ahead of its last
        # one's counts, laid out further on: worker/verify_ahead.py.)
        emitted, ids = num_emitted.cpu().numpy(), tokens.cpu().numpy()
        starts = np.cumsum(1 + num_drafts) - 1 - num_drafts
        exact_first = first_positions if shift is None else first_positions - shift.cpu().numpy()
        for i, first in enumerate(exact_first.tolist()):
            records.append((np.arange(first, first + emitted[i]), ids[i, : emitted[i]],
                            target_states[starts[i] : starts[i] + emitted[i]].cpu().clone()))
        return draft_after_verify(states, rows, first_positions, num_drafts, target_states, tokens, num_emitted,
                                  shift)

    draft_after_verify = proposer.draft_after_verify
    proposer._forward = recording(proposer._forward)
    proposer._step = recording(proposer._step)
    proposer.observe = first_pass_of(proposer.observe)
    proposer.propose = first_pass_of(proposer.propose)
    proposer.draft_after_verify = recorded_after_verify
    return records


def check_target_hidden_states(target_path: str, sequences: list[list[int]], records: list) -> None:
    """Each hidden state the head read is the target's (Hugging Face's own forward pass) at that position, of
    a sequence whose next token is the one the head was given."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target_path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = [model(torch.tensor([s]), output_hidden_states=True).hidden_states[-1][0] for s in sequences]
    checked = 0
    for positions, next_tokens, states in records:
        for p, t, h in zip(positions.tolist(), next_tokens.tolist(), states):
            if not any(p + 1 < len(s) and s[p + 1] == t and torch.allclose(hs[p], h, atol=1e-3)
                       for s, hs in zip(sequences, hidden)):
                # Name the nearest state the head could have been given: a neighbour's (an ordering fault) or
                # this position's, off by rounding.
                diff, where = min(((hs - h).abs().max(dim=-1).values.min().item(),
                                   (i, (hs - h).abs().max(dim=-1).values.argmin().item()))
                                  for i, hs in enumerate(hidden))
                pytest.fail(f"position {p} (next token {t}): not the target's hidden state; nearest: sequence "
                            f"{where[0]} position {where[1]}, max abs diff {diff:.2e}")
            checked += 1
    assert checked > 100, checked


@pytest.fixture(scope="module")
def eagle_plain(eagle_target_and_head):
    outputs, _, _ = run(eagle_target_and_head[0], ENGINES["default"])
    return outputs


# A draft tree (speculative_token_tree) of depth 3 whose second branches are often right where the first is not.
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0)]


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_an_eagle_head_drafts_from_the_target_hidden_states_and_changes_no_token(eagle_target_and_head,
                                                                                  eagle_plain, engine, tree):
    target, head = eagle_target_and_head
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": 3}
    if tree is not None:
        spec["speculative_token_tree"] = tree
    llm = LLM(target.path, skip_tokenizer_init=True, max_model_len=128, dtype="float32", **ENGINES[engine],
              speculative_config=spec)
    always_draft(llm)
    records = record_target_hidden_states(llm)
    outputs = llm.generate(*workload(), use_tqdm=False)
    assert [c.token_ids for o in outputs for c in o.outputs] == [c.token_ids for o in eagle_plain for c in o.outputs]
    check_target_hidden_states(target.path, sequences_of(eagle_plain), records)
    for got, want in zip(outputs, eagle_plain):
        for g, w in zip(got.outputs, want.outputs):
            for g_pos, w_pos in zip(g.logprobs or [], w.logprobs or []):
                assert list(g_pos) == list(w_pos)
                for token in g_pos:
                    assert g_pos[token].logprob == pytest.approx(w_pos[token].logprob, abs=1e-4)
    stats = llm.engine.last_stats.spec_decoding
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.3, stats
    assert stats.accepted_per_position[2] > 0, stats
    kv = llm.engine.core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_blocks, "blocks leaked"
    if engine == "preempting":
        assert llm.engine.last_stats.num_preemptions > 0


def test_a_random_eagle_head_is_mostly_rejected_and_changes_no_token(eagle_target_and_head, eagle_plain, tmp_path):
    # The other spelling of the layout: `model.`-prefixed names, an `fc.bias`, safetensors.
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    target, _ = eagle_target_and_head
    torch.manual_seed(4)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    config.save_pretrained(tmp_path)
    layer = LlamaForCausalLM(config).model.layers[0].state_dict()
    tensors = {f"model.layers.0.{n}": t.contiguous() for n, t in layer.items() if not n.startswith("input_")}
    tensors["model.fc.weight"] = torch.randn(64, 128) * 0.1
    tensors["model.fc.bias"] = torch.randn(64) * 0.1
    save_file(tensors, str(tmp_path / "model.safetensors"))
    spec = {"method": "eagle", "model": str(tmp_path), "num_speculative_tokens": 2}
    llm = LLM(target.path, skip_tokenizer_init=True, max_model_len=128, dtype="float32",
              **ENGINES["chunked-prefill"], speculative_config=spec)
    always_draft(llm)
    outputs = llm.generate(*workload(), use_tqdm=False)
    assert [c.token_ids for o in outputs for c in o.outputs] == [c.token_ids for o in eagle_plain for c in o.outputs]
    stats = llm.engine.last_stats.spec_decoding
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate < 0.5, stats


def test_an_eagle_head_of_another_width_is_refused(eagle_target_and_head, tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="hidden size"):
        LLM(eagle_target_and_head[0].path, skip_tokenizer_init=True, speculative_config={
            "method": "eagle", "model": str(tmp_path), "num_speculative_tokens": 2})


def test_a_config_naming_a_model_without_a_method_takes_vllms_inference(tiny_llama, eagle_target_and_head, tmp_path):
    """vLLM's draft-model spelling names the model and no method ({"model": ..., "num_speculative_tokens": 5}); it
    was refused ('needs 'method''). As vLLM, the method comes from the model: an EAGLE-3 head by its config's
    architectures (or "eagle3" in its name), an EAGLE-1 head by "eagle-" in its name, else a draft model."""
    import json
    import shutil

    from tokenmill.config import SpeculativeConfig

    target, head = eagle_target_and_head
    eagle1 = tmp_path / "EAGLE-tiny-head"
    shutil.copytree(head, eagle1)
    eagle3 = tmp_path / "tiny-head"
    eagle3.mkdir()
    (eagle3 / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    for model, method in ((tiny_llama.path, "draft_model"), (eagle1, "eagle"), (eagle3, "eagle3")):
        assert SpeculativeConfig.from_dict({"model": str(model), "num_speculative_tokens": 2}).method == method
    llm = LLM(target.path, skip_tokenizer_init=True, max_model_len=128, dtype="float32", kv_cache_space=0.01,
              speculative_config={"model": str(eagle1), "num_speculative_tokens": 2})
    always_draft(llm)
    llm.generate(SHORT_PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert llm.engine.last_stats.spec_decoding.num_accepted_tokens > 0  # the head drafts as the target would


def test_vllms_draft_tensor_parallel_size_is_taken(eagle_target_and_head):
    """vLLM's EAGLE examples pass draft_tensor_parallel_size (1, or the target's size), which was refused as an
    unknown key. The drafter shards over the target's ranks whatever it says; other values are refused, as vLLM
    refuses them."""
    target, head = eagle_target_and_head
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}
    llm = LLM(target.path, skip_tokenizer_init=True, max_model_len=128, dtype="float32", kv_cache_space=0.01,
              speculative_config=spec)
    always_draft(llm)
    llm.generate(SHORT_PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert llm.engine.last_stats.spec_decoding.num_draft_tokens > 0
    with pytest.raises(ValueError, match=r"draft_tensor_parallel_size must be 1 or the target's "
                                         r"tensor_parallel_size \(1\), got 2"):
        EngineConfig.from_kwargs(target.path, speculative_config={**spec, "draft_tensor_parallel_size": 2})


def test_an_eagle_head_trained_on_fewer_positions_drafts_past_them(eagle_target_and_head, eagle_plain, tmp_path):
    """An EAGLE head's config states the length it was trained at, often below the target's (8192 beside a 128K
    target). RoPE has no learned positions: the head drafts at every position the target reaches, as EAGLE-3 heads
    do (it was refused: 'the EAGLE head takes 32 positions, fewer than max_model_len=128')."""
    import json
    import shutil

    target, head = eagle_target_and_head
    short = tmp_path / "head"
    shutil.copytree(head, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32}))
    llm = LLM(target.path, skip_tokenizer_init=True, max_model_len=128, dtype="float32", **ENGINES["default"],
              speculative_config={"method": "eagle", "model": str(short), "num_speculative_tokens": 3})
    always_draft(llm)
    outputs = llm.generate(*workload(), use_tqdm=False)  # most of the sequences run past position 32
    assert [c.token_ids for o in outputs for c in o.outputs] == [c.token_ids for o in eagle_plain for c in o.outputs]
    stats = llm.engine.last_stats.spec_decoding
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.3, stats


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_an_eagle_head_that_is_no_folder_with_config_json_is_a_one_line_error(eagle_target_and_head, tmp_path, method):
    """A .gguf file (a whole model) or a folder without config.json: transformers' errors (an OSError about JSON,
    one about a model_type) said neither what the method takes nor that draft_model takes whole models."""
    (tmp_path / "draft.gguf").write_bytes(b"GGUF")
    for path, what in ((tmp_path / "draft.gguf", "is a file"), (tmp_path, "is a folder without config.json")):
        with pytest.raises(ValueError, match=f"takes the EAGLE head's folder .*{what}.*method 'draft_model'"):
            LLM(eagle_target_and_head[0].path, skip_tokenizer_init=True, speculative_config={
                "method": method, "model": str(path), "num_speculative_tokens": 2})


class ScriptedTreeProposer(ScriptedProposer):
    """Drafts trees of TREE's shape (spec/tree.py) around the known continuation: under each node on the true
    path, the child of a rank chosen per step and node holds the true next token, or (one time in four) no
    child does; the other children hold other tokens. So every branch, and rejections at every depth, occur."""

    def __init__(self, sequences: list[list[int]], tree) -> None:
        super().__init__(sequences)
        self.tree = tree
        self.num_children = np.bincount(tree.parent + 1, minlength=tree.num_nodes + 1)

    def propose(self, states, rows: np.ndarray, max_drafts: np.ndarray) -> list[np.ndarray]:
        drafts = []
        for row, k in zip(rows.tolist(), max_drafts.tolist()):
            tokens = states.token_ids[row, : states.num_tokens[row]].tolist()
            key = zlib.crc32(str(tokens).encode())
            continuation = self.continuation(tokens) if key % 6 else []
            nodes, on_path = [], []
            for i in range(min(k, self.tree.num_nodes) if continuation else 0):
                parent, depth, rank = (int(a[i]) for a in (self.tree.parent, self.tree.depth, self.tree.rank))
                true = continuation[depth - 1] if depth <= len(continuation) else 7
                right = zlib.crc32(f"{key}:{parent}".encode()) % (self.num_children[parent + 1] + 1)
                on_path.append((parent < 0 or on_path[parent]) and rank == right and depth <= len(continuation))
                nodes.append(true if on_path[-1] else (true + 1 + rank) % 200)
            self.num_proposed += len(nodes)
            drafts.append(np.array(nodes, dtype=np.int64))
        return drafts


@pytest.mark.parametrize("engine", list(ENGINES))
def test_scripted_trees_accept_every_branch_and_change_no_token(eagle_target_and_head, eagle_plain, engine):
    """The accepted path of a tree goes through any branch: its KV moves to the request's next slots and the
    rejected nodes' slots are written again, in every engine mode (the tokens and logprobs show it)."""
    from tokenmill.config import parse_token_tree
    from tokenmill.spec.tree import TokenTree

    target, head = eagle_target_and_head
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": 3, "speculative_token_tree": TREE}
    llm = LLM(target.path, skip_tokenizer_init=True, max_model_len=128, dtype="float32", **ENGINES[engine],
              speculative_config=spec)
    use_scripted_proposer(llm, ScriptedTreeProposer(sequences_of(eagle_plain), TokenTree.from_paths(
        parse_token_tree(TREE))))
    accepted_nodes = record_accepted_paths(llm)
    outputs = llm.generate(*workload(), use_tqdm=False)
    check_same_tokens_and_logprobs(outputs, eagle_plain)
    # Both of the root's children, and second-level nodes other than node 2, were accepted: their KV moved.
    assert {0, 1}.issubset(path[0] for path in accepted_nodes)
    assert {3, 4}.issubset(path[1] for path in accepted_nodes)
    stats = llm.engine.last_stats.spec_decoding
    assert stats.accepted_per_position[2] > 0 and stats.num_accepted_tokens < stats.num_draft_tokens, stats
    kv = llm.engine.core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_blocks, "blocks leaked"
    if engine == "preempting":
        assert llm.engine.last_stats.num_preemptions > 0


def record_accepted_paths(llm: LLM) -> list[list[int]]:
    """The accepted nodes of every verified tree from now on."""
    import tokenmill.worker.tree_verify as module

    paths, verify_tree = [], module.verify_tree

    def recording(logits, batch, metadata):
        tokens, counts, path = verify_tree(logits, batch, metadata)
        paths.extend(p for p in path.tolist() if p[0] >= 0)
        return tokens, counts, path

    module.verify_tree = recording
    return paths


def check_same_tokens_and_logprobs(outputs, plain) -> None:
    assert [c.token_ids for o in outputs for c in o.outputs] == [c.token_ids for o in plain for c in o.outputs]
    for got, want in zip(outputs, plain):
        for g, w in zip(got.outputs, want.outputs):
            assert (g.logprobs is None) == (w.logprobs is None)
            for g_pos, w_pos in zip(g.logprobs or [], w.logprobs or []):
                assert list(g_pos) == list(w_pos)
                for token in g_pos:
                    assert g_pos[token].logprob == pytest.approx(w_pos[token].logprob, abs=1e-4)
                    assert g_pos[token].rank == w_pos[token].rank


def test_ngram_drafting_for_sequences_shorter_than_the_lookup_keeps_the_engine_up(tiny_llama):
    # The default lookup is 5 tokens; drafting for a 3-token sequence (a 2-token prompt's first draft, in a fresh
    # engine) crashed the engine core: the lookup sliced from the sequence's end.
    llm = LLM(tiny_llama.path, skip_tokenizer_init=True, max_model_len=128, dtype="float32", kv_cache_space=0.01,
              speculative_config=SPEC)
    prompts = [{"prompt_token_ids": [3, 3]}, {"prompt_token_ids": [5]}]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [len(out.outputs[0].token_ids) for out in outputs] == [12, 12]
