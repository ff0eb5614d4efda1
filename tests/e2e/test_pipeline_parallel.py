"""Pipeline parallelism on the CPU (gloo): the layers split over stages, each stage a process, against one.

A tiny seeded random Llama (3 layers: an uneven 2 + 1 split; tied embeddings, so the last stage holds the
embedding for its LM head) runs on two stages with async scheduling, chunked prefill, prefix caching, ngram
drafts and a KV pool small enough to preempt, and must give the one-process engine's tokens: greedy,
seeded random, n > 1 and penalties alike, with the same logprobs and prompt logprobs (the stages compute
exactly what one process does; only the last samples, the others are sent its tokens). It does so with two
micro-batches in flight (the default: each stage computes one while the other computes the other, a request
in one at a time), through an abort while its batch is in flight, and with one batch at a time. Qwen2-MoE (a
dense layer, then experts behind a shared expert) on two stages must give transformers' greedy tokens, and
two stages of two tensor-parallel ranks each the one-process engine's.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tokenmill import LLM, SamplingParams

ENGINE = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=128)
FEATURES = dict(ENGINE, async_scheduling=True, max_num_batched_tokens=24, num_gpu_blocks_override=12,
                speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
LOGPROB_ATOL = 1e-4
"""Two stages compute what one process does; two tensor-parallel ranks sum in another order (~1e-6)."""


def build_llama(folder, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=301, max_position_embeddings=256, bos_token_id=1,
                                   eos_token_id=2, initializer_range=0.2),  # peaked logits: no greedy near tie
                            **overrides})
    LlamaForCausalLM(config).eval().save_pretrained(folder)


def prompts() -> list[dict]:
    shared = [(5 * j) % 200 + 3 for j in range(20)]  # a prefix long enough to hit the prefix cache
    repeating = [{"prompt_token_ids": [9, 40, 41, 42, 43] * 6}]  # ngram lookups find a match: drafts
    return [{"prompt_token_ids": shared + [(7 * i + j) % 250 + 3 for j in range(3 + 5 * i)]}
            for i in range(4)] + repeating


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=2, prompt_logprobs=1),
    SamplingParams(temperature=1.0, seed=7, max_tokens=14, ignore_eos=True, logprobs=0),
    SamplingParams(temperature=0.8, seed=3, max_tokens=14, ignore_eos=True, repetition_penalty=1.3,
                   presence_penalty=0.5),
    SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
]


def assert_same_outputs(expected, actual) -> None:
    for want, got in zip(expected, actual, strict=True):
        assert len(got.outputs) == len(want.outputs)
        for w, g in zip(want.outputs, got.outputs):
            assert g.token_ids == w.token_ids
            for w_entry, g_entry in zip(w.logprobs or [], g.logprobs or [], strict=True):
                assert g_entry.keys() == w_entry.keys()
                for token, entry in w_entry.items():
                    assert g_entry[token].logprob == pytest.approx(entry.logprob, abs=LOGPROB_ATOL)
        for w_entry, g_entry in zip(want.prompt_logprobs or [], got.prompt_logprobs or [], strict=True):
            assert (w_entry is None) == (g_entry is None)
            for token, entry in (w_entry or {}).items():
                assert g_entry[token].logprob == pytest.approx(entry.logprob, abs=LOGPROB_ATOL)


def generate_recording(llm: LLM) -> tuple[list, list]:
    """The outputs, and the scheduler stats of every step (draft whenever the proposer finds a match: the
    CPU's measured step cost would rather not)."""
    core, stats = llm.engine.core, []
    step = core.step

    def recording_step():
        outputs = step()
        if outputs.scheduler_stats is not None:
            stats.append(outputs.scheduler_stats)
        return outputs

    core.step = recording_step
    core.scheduler.draft_budget.cost, core.scheduler.draft_budget.min_gain = None, 0.0
    try:
        return llm.generate(prompts(), PARAMS, use_tqdm=False), stats
    finally:
        del core.step


def record_overlaps(scheduler) -> list[bool]:
    """From now on, for each batch scheduled: whether it samples for some requests while another batch in flight
    samples for others (asserting that no request is in both)."""
    overlaps = []
    schedule = scheduler.schedule

    def recording_schedule():
        busy = {rid for step in scheduler.steps_in_flight for rid, (request, _) in step.items()
                if request.num_output_placeholders}
        output = schedule()
        assert not busy & set(output.num_scheduled_tokens)
        samples = any(scheduler.requests[rid].num_output_placeholders for rid in output.num_scheduled_tokens)
        overlaps.append(bool(busy) and samples)
        return output

    scheduler.schedule = recording_schedule
    return overlaps


def abort_while_its_batch_is_in_flight(llm: LLM, reference) -> None:
    """r0 is aborted while a micro-batch computes its token and its id is reused at once: both runs of r0,
    and r4 beside them, give the one-process greedy tokens."""
    engine, greedy = llm.engine, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    for i in (0, 4):
        engine.add_request(f"r{i}", prompts()[i], greedy)
    while not any(step.get("r0") for step in engine.core.scheduler.steps_in_flight):
        engine.step()
    engine.abort_request(["r0"])
    engine.add_request("r0", prompts()[0], greedy)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert finished == {"r0": reference[0].outputs[0].token_ids, "r4": reference[4].outputs[0].token_ids}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(folder, the one-process engine's outputs with every feature on); made before any staged engine, since
    a process's layers take their stage from its group."""
    folder = tmp_path_factory.mktemp("llama-pp")
    build_llama(folder, tie_word_embeddings=True)
    llm = LLM(str(folder), **FEATURES)
    reference, _ = generate_recording(llm)
    llm.engine.core.shutdown()
    return folder, reference


@pytest.mark.parametrize("batches_in_flight", [None, 1])
def test_two_stages_give_the_one_process_outputs(llama, batches_in_flight):
    folder, reference = llama
    llm = LLM(str(folder), **FEATURES, pipeline_parallel_size=2, pipeline_batches_in_flight=batches_in_flight)
    try:
        core = llm.engine.core
        assert core.executor.world_size == 2 and core.async_scheduling
        driver = core.executor.driver_worker  # rank 0: the last stage, layer 2 of 0..2
        assert driver.model.model.stage.start == 2 and len(driver.attn_layers) == 1
        overlaps = record_overlaps(core.scheduler) if batches_in_flight is None else None
        actual, stats = generate_recording(llm)
        # The features composed with the stages did run.
        assert sum(s.prefix_cache_hits for s in stats) > 0
        assert stats[-1].spec_decoding.num_draft_tokens > 0
        assert core.scheduler.num_preemptions > 0
        assert_same_outputs(reference, actual)
        if overlaps is not None:
            assert sum(overlaps) > len(overlaps) / 2  # two micro-batches ran at once over most steps
            abort_while_its_batch_is_in_flight(llm, reference)
        kv = core.scheduler.kv
        assert kv.pool.num_free_blocks == kv.pool.num_blocks
        # Stopped with a step queued on the driver: the first stage, waiting for its share, is not left behind.
        llm.engine.add_request("late", prompts()[1], SamplingParams(max_tokens=50))
        for _ in range(3):
            llm.engine.step()
        assert core._in_flight
        start = time.monotonic()
        core.shutdown()
        assert time.monotonic() - start < 3  # not the 5 s a stuck rank is given before it is killed
    finally:
        llm.engine.core.shutdown()
    from tokenmill.distributed.parallel_state import get_pp_size, is_distributed

    assert not is_distributed() and get_pp_size() == 1  # a one-process engine may start here again
    assert all(child.poll() is not None for child in core.executor._procs.values())


@pytest.mark.slow
def test_two_stages_of_two_tensor_parallel_ranks(llama):
    """Four processes: stages of two ranks each, the stage's all-reduces within its own group."""
    folder, _ = llama
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    expected = LLM(str(folder), **ENGINE).generate(prompts(), params, use_tqdm=False)
    llm = LLM(str(folder), **ENGINE, tensor_parallel_size=2, pipeline_parallel_size=2, async_scheduling=True,
              max_num_batched_tokens=24)
    try:
        assert llm.engine.core.executor.world_size == 4
        assert_same_outputs(expected, llm.generate(prompts(), params, use_tqdm=False))
    finally:
        llm.engine.core.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])
def test_stages_on_gpus(llama, tp, pp):
    """NCCL: stage-to-stage sends, the token broadcast, each stage's memory profile (CUDA graphs off)."""
    if torch.cuda.device_count() < tp * pp:
        pytest.skip(f"needs {tp * pp} GPUs")
    folder, _ = llama
    gpu = dict(ENGINE, device="cuda", max_num_batched_tokens=24, async_scheduling=True)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)  # tokens only: TF32 may round
    llm = LLM(str(folder), **gpu)
    expected = llm.generate(prompts(), params, use_tqdm=False)
    llm.engine.core.shutdown()
    llm = LLM(str(folder), **gpu, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        assert_same_outputs(expected, llm.generate(prompts(), params, use_tqdm=False))
    finally:
        llm.engine.core.shutdown()


def test_two_stages_of_a_mixture_of_experts_give_transformers_greedy_tokens(tmp_path):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen2MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64, mlp_only_layers=[0], bos_token_id=1,
                            eos_token_id=2, tie_word_embeddings=False,
                            initializer_range=0.2)  # sharp routing and peaked logits: no near ties
    hf_model = Qwen2MoeForCausalLM(config).eval()
    hf_model.save_pretrained(tmp_path)
    batch = [[(7 * i + 3 * j) % 250 + 3 for j in range(4 + 9 * i)] for i in range(3)]
    with torch.no_grad():
        expected = [hf_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                      do_sample=False, max_new_tokens=10, eos_token_id=None)[0, len(p):].tolist()
                    for p in batch]
    llm = LLM(str(tmp_path), **ENGINE, pipeline_parallel_size=2, max_num_batched_tokens=16)
    try:
        model = llm.engine.core.executor.driver_worker.model
        # The last stage holds the experts' layer, the norm and the LM head, not the (untied) embedding.
        assert type(model.model.embed_tokens).__name__ == "OnAnotherStage"
        assert type(model.model.layers[0]).__name__ == "OnAnotherStage"
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch],
                               SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
        assert [list(out.outputs[0].token_ids) for out in outputs] == expected
    finally:
        llm.engine.core.shutdown()


def test_two_stages_mask_by_grammar_and_end_a_request_left_no_token(tmp_path, smollm2_tokenizer):
    """Structured outputs on two stages (the tiny Llama under the default model's tokenizer: the grammars, not
    the weights, decide what may be drawn): the last stage masks by the grammars and samples, and a request
    whose bans leave its grammar no token ends there with "error" (the driver, on the last stage, reports the
    mark; the first stage embeds the drawn token, and the request ends before it matters), as
    test_structured_outputs.py checks in one process."""
    from tokenmill.sampling_params import StructuredOutputsParams

    build_llama(tmp_path, vocab_size=len(smollm2_tokenizer), bos_token_id=smollm2_tokenizer.bos_token_id,
                eos_token_id=smollm2_tokenizer.eos_token_id)
    smollm2_tokenizer.save_pretrained(tmp_path)
    ask = [{"role": "user", "content": "Which city is the capital of France?"}]
    choice = StructuredOutputsParams(choice=["Paris", "London", "Rome"])
    llm = LLM(str(tmp_path), kv_cache_space=0.01, max_model_len=256, dtype="float32", pipeline_parallel_size=2)
    try:
        paris = llm.get_tokenizer().encode("Paris", add_special_tokens=False)
        params = [SamplingParams(temperature=0, max_tokens=20, structured_outputs=choice, allowed_token_ids=paris),
                  SamplingParams(temperature=0, max_tokens=20, structured_outputs=choice),
                  SamplingParams(temperature=0.8, seed=1, max_tokens=20, structured_outputs=choice,
                                 allowed_token_ids=[0])]
        banned, free, dead = (out.outputs[0] for out in llm.chat([ask] * 3, params, use_tqdm=False))
    finally:
        llm.engine.core.shutdown()
    assert (banned.finish_reason, banned.token_ids, banned.text) == ("error", paris, "Paris")
    assert free.finish_reason == "stop" and free.text in ("Paris", "London", "Rome")
    assert (dead.finish_reason, dead.token_ids) == ("error", [])


def test_a_dead_stage_ends_the_engine_with_a_clear_error(tmp_path):
    build_llama(tmp_path)
    llm = LLM(str(tmp_path), **ENGINE, pipeline_parallel_size=2)
    executor = llm.engine.core.executor
    (child,) = executor._procs.values()  # rank 1: the first stage
    try:
        os.kill(child.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 .* exited with code -9"):
            llm.generate(prompts(), SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - start < 10
    finally:
        llm.engine.core.shutdown()
    assert child.poll() is not None


def test_layers_split_evenly_and_contiguously():
    from tokenmill.model.stage import stage_layer_range

    assert [stage_layer_range(7, s, 3) for s in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [stage_layer_range(4, s, 2) for s in range(2)] == [(0, 2), (2, 4)]
    assert stage_layer_range(5, 0, 1) == (0, 5)
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        stage_layer_range(2, 0, 3)


def test_stage_loads_only_its_own_tensors():
    from torch import nn

    from tokenmill.model.stage import OnAnotherStage, owned_weights

    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([OnAnotherStage(), nn.Linear(2, 2)])
    model.model.embed_tokens = OnAnotherStage()
    model.lm_head = nn.Linear(2, 2)
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.w",
             "model.layers.10.mlp.w", "lm_head.weight"]
    kept = [name for name, _ in owned_weights(model, ((n, None) for n in names))]
    assert kept == ["model.layers.1.mlp.w", "model.layers.10.mlp.w", "lm_head.weight"]


def test_what_does_not_compose_is_refused():
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive integer"):
        LLM("unused", pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="'eagle' does not run pipeline-parallel"):
        LLM("unused", pipeline_parallel_size=2,
            speculative_config={"method": "eagle", "model": "x", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        LLM("unused", pipeline_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match=r"pipeline_batches_in_flight must be an integer from 1 to pipeline_"
                                         r"parallel_size \(2\), got 3"):
        LLM("unused", pipeline_parallel_size=2, pipeline_batches_in_flight=3)
    from transformers import LlamaConfig

    from tokenmill.executor.base import check_pipeline_parallel

    check_pipeline_parallel(LlamaConfig(num_hidden_layers=2), 2)
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds the model's 2 decoder layers"):
        check_pipeline_parallel(LlamaConfig(num_hidden_layers=2), 3)
