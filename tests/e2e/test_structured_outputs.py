"""Structured outputs through the offline engine on the real default model: every output obeys its spec
(JSON schemas checked with jsonschema), in every engine mode, with n > 1, logprobs and speculation."""

import dataclasses
import functools
import json
import os
import re
import signal
import threading

import jsonschema
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import StructuredOutputsConfig
from tokenmill.request import GRAMMAR_FAILED
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured import compiler as compiler_module

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a fictional person as JSON with a name and an age."}]
REGEX = r"(yes|no), because [a-z ]{3,30}\."
CHOICES = ["Paris", "London", "Rome"]
GRAMMAR = 'root ::= "The answer is " digit digit? "."\ndigit ::= [0-9]'


def check(spec: StructuredOutputsParams, text: str) -> None:
    if spec.json is not None:
        value = json.loads(text)
        jsonschema.validate(value, spec.json)
        if spec.json is SITE:  # jsonschema checks no uri format without rfc3987 installed: its scheme, no spaces
            assert re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*:\S*", value["site"]), text
    elif spec.json_object:
        assert isinstance(json.loads(text), dict), text
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice, text
    else:
        assert re.fullmatch(r"The answer is [0-9][0-9]?\.", text), text


SPECS = [StructuredOutputsParams(json=PERSON), StructuredOutputsParams(json_object=True),
         StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(choice=CHOICES),
         StructuredOutputsParams(grammar=GRAMMAR)]
GUIDED = [StructuredOutputsParams(regex=REGEX, backend="guidance"),
          StructuredOutputsParams(choice=CHOICES, backend="guidance"),
          StructuredOutputsParams(grammar=GRAMMAR, backend="guidance")]  # GBNF, which llguidance takes as Lark
"""Under llguidance (the guidance backend)."""
# Schemas xgrammar would enforce in part only (json_schema_check.py): backend auto gives them to llguidance.
CODE = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$", "minLength": 3,
                                                  "maxLength": 5}}, "required": ["code"], "additionalProperties": False}
SITE = {"type": "object", "properties": {"site": {"type": "string", "format": "uri", "maxLength": 30}},
        "required": ["site"], "additionalProperties": False}


def generate_all(llm: LLM, temperature: float = 0.0, **params):
    sampling = [SamplingParams(temperature=temperature, max_tokens=80, structured_outputs=spec, **params)
                for spec in SPECS]
    return llm.chat([ASK] * len(SPECS), sampling, use_tqdm=False)


@pytest.fixture(scope="module")
def busy_llm(smollm2_path):
    """Async scheduling, 16-token prefill chunks and a pool so small that requests get preempted (no prefix
    caching, so the samples of one prompt do not share its blocks); the matchers in a grammar process of their
    own, as on a GPU (the CPU's default keeps them in the engine's process: smollm2_llm's)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("tokenmill.structured.matchers.use_grammar_process", lambda device: True)
        return LLM(smollm2_path, max_model_len=256, num_gpu_blocks_override=17, max_num_batched_tokens=16,
                   async_scheduling=True, enable_prefix_caching=False)


def test_every_kind_of_spec_is_obeyed(smollm2_llm):
    for spec, out in zip(SPECS, generate_all(smollm2_llm)):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0]
        check(spec, out.outputs[0].text)


def test_specs_hold_under_async_scheduling_chunked_prefill_and_preemption(busy_llm):
    # Prompts of ~8 blocks each, 5 of them (their 2 samples share one): more than the pool's 17 blocks.
    story = "Once upon a time a clockmaker lived at the edge of a forest and wound his clocks every morning. " * 5
    ask = [{"role": "user", "content": story + ASK[0]["content"]}]
    specs = SPECS + GUIDED[1:2]
    sampling = [SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=80, structured_outputs=spec) for spec in specs]
    outputs = busy_llm.chat([ask] * len(specs), sampling, use_tqdm=False)
    for spec, out in zip(specs, outputs):
        assert len(out.outputs) == 2
        for sample in out.outputs:
            if sample.finish_reason == "stop":
                check(spec, sample.text)
    assert busy_llm.engine.last_stats.num_preemptions > 0
    assert busy_llm.engine.core.awaiting_grammar.compiler.num_compiled == 0  # the grammar process compiled them


def test_tokens_still_on_the_device_reach_the_grammars_at_the_engines_update(busy_llm, monkeypatch):
    """On a GPU the last step's tokens are mostly still on the device when the next step is launched (its sampler
    was deferred to that launch): the grammar process then gets them, and the step's mask request, when the engine
    takes them in its update of the last step (PendingOutput.when_tokens), not by a wait in the launch. Here tokens
    count as arrived only once taken, so every step goes that way; the greedy and seeded outputs (n = 2, preempted)
    are those of the same engine with the tokens on the host at once (the CPU's)."""
    from tokenmill.worker.model_runner import ModelRunner
    from tokenmill.worker.pending_output import PendingOutput

    # Greedy, and seeded samples (n = 2) of long prompts that the small pool preempts.
    story = "Once upon a time a clockmaker lived at the edge of a forest and wound his clocks every morning. " * 5
    ask = [{"role": "user", "content": story + ASK[0]["content"]}]
    seeded = [SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=40, structured_outputs=spec) for spec in SPECS]

    def run():
        preemptions = busy_llm.engine.last_stats.num_preemptions if busy_llm.engine.last_stats else 0
        outputs = generate_all(busy_llm) + busy_llm.chat([ask] * len(SPECS), seeded, use_tqdm=False)
        assert busy_llm.engine.last_stats.num_preemptions > preemptions
        return outputs, [[sample.token_ids for sample in out.outputs] for out in outputs]

    run()  # the grammars compiled: both runs below schedule alike
    _, expected = run()
    handed_over = []
    start_grammars = ModelRunner._start_grammars
    monkeypatch.setattr(PendingOutput, "has_tokens", lambda self: self._output is not None)
    monkeypatch.setattr(ModelRunner, "_start_grammars",
                        lambda self, *args: handed_over.append(1) or start_grammars(self, *args))
    outputs, tokens = run()
    assert len(handed_over) > 10
    assert tokens == expected
    for spec, out in zip(SPECS + SPECS, outputs):
        for sample in out.outputs:
            if sample.finish_reason == "stop":
                check(spec, sample.text)


@pytest.mark.parametrize("schema, options", [
    (PERSON, {}),
    (PERSON, {"backend": "auto", "disable_any_whitespace": True, "disable_additional_properties": False,
              "disable_fallback": False}),
    (json.dumps(PERSON), {"backend": "auto", "disable_any_whitespace": True, "disable_additional_properties": False,
                          "disable_fallback": False}),
], ids=["dict_options_unset", "dict_backend_auto", "text_backend_auto"])
def test_the_callers_spec_is_left_as_it_was(smollm2_llm, schema, options):
    """The engine enforces its own copy of a spec (the engine's options filled in, the backend resolved, a dict
    schema kept as its JSON text): the caller's object, which it may send again or elsewhere, is not changed."""
    spec = StructuredOutputsParams(json=schema, **options)
    before = dataclasses.replace(spec)
    out = smollm2_llm.chat([ASK], SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec),
                           use_tqdm=False)
    check(StructuredOutputsParams(json=PERSON), out[0].outputs[0].text)
    assert spec == before and spec.json is schema


def test_a_spec_the_grammar_process_cannot_compile_fails_only_its_request(busy_llm, monkeypatch):
    """The grammar process compiles the grammars (the engine core's compiler delegates to it): a spec that fails
    there (let past the frontend, which would refuse it) fails its request, saying why (finish_reason "error", the
    compiler's reason its stop_reason), and the engine and its grammar process serve the others."""
    monkeypatch.setattr("tokenmill.engine.input_processor.validate_structured_outputs",
                        lambda params, backend: ("xgrammar", ()))
    bad = StructuredOutputsParams(regex="(abc")
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec) for spec in (bad, SPECS[2])]
    outs = busy_llm.chat([ASK, ASK], params, use_tqdm=False)
    failed = outs[0].outputs[0]
    assert failed.finish_reason == "error" and not failed.token_ids
    assert failed.stop_reason.startswith(GRAMMAR_FAILED) and "regex" in failed.stop_reason, failed
    assert outs[1].outputs[0].finish_reason == "stop"
    check(SPECS[2], outs[1].outputs[0].text)
    assert busy_llm.engine.core.awaiting_grammar.compiler.num_compiled == 0


@pytest.mark.parametrize("ahead", [True, False], ids=["computed-ahead", "waits"])
@pytest.mark.parametrize("engine", ["smollm2_llm", "busy_llm"])
def test_the_prompt_is_computed_while_its_grammar_compiles(engine, ahead, request, monkeypatch):
    """A constrained request's prompt is scheduled at once, all but its tail (the blocks before its last token),
    while its grammar compiles (held back here: the compile in the engine's pool blocked, or the grammar process
    stopped); an unconstrained request beside it runs to its end meanwhile. Once the grammar is ready the request
    samples the tokens that it samples when its grammar was compiled before it came (greedy). In the engine's
    process (chunks of the whole budget, sync) and with a grammar process (16-token chunks, async scheduling).
    The GPU's way; on the CPU (`waits`, the engine's choice there) the prompt waits whole for its grammar."""
    llm = request.getfixturevalue(engine)
    monkeypatch.setattr(llm.engine.core.scheduler.gate, "compute_ahead", ahead)
    runner = llm.engine.core.executor.driver_worker.model_runner
    held = threading.Event()
    if engine == "smollm2_llm":
        build = compiler_module.build_grammar
        monkeypatch.setattr(compiler_module, "build_grammar", lambda params: held.wait(30) and build(params))
        let_go = held.set
    else:
        pid = runner.grammar_rows._matchers.pid
        os.kill(pid, signal.SIGSTOP)
        let_go = functools.partial(os.kill, pid, signal.SIGCONT)
    spec = StructuredOutputsParams(regex=rf"(yes|no), since [a-z ]{{3,{20 + len(engine) + 9 * ahead}}}\.")  # new
    story = "Once upon a time a clockmaker lived at the edge of a forest and wound his clocks every morning. " * 3
    prompt = story + "Did he wind them on Sundays? Answer yes or no, and why: "
    gated = SamplingParams(temperature=0, max_tokens=30, structured_outputs=spec)
    engine_ = llm.engine
    try:
        engine_.add_request("gated", prompt, gated)
        engine_.add_request("plain", prompt, SamplingParams(temperature=0, max_tokens=4))
        [sample_id] = engine_.output_processor.sample_ids("gated")
        state = engine_.core.scheduler.requests[sample_id]
        computed_ahead = (state.num_prompt_tokens - 1) // 16 * 16 if ahead else 0
        finished = {}
        for _ in range(200):
            finished.update((out.request_id, out) for out in engine_.step() if out.finished)
            if "plain" in finished and state.num_computed_tokens == computed_ahead:
                break
        assert "plain" in finished and "gated" not in finished
        assert state.num_computed_tokens == computed_ahead and not state.output_token_ids
        assert computed_ahead > 32 or not ahead
    except BaseException:
        engine_.abort_request(["gated", "plain"])  # the shared engine stays idle for the other tests
        raise
    finally:
        let_go()
    for _ in range(500):
        if not engine_.has_unfinished_requests():
            break
        finished.update((out.request_id, out) for out in engine_.step() if out.finished)
    out = finished["gated"].outputs[0]
    reference = llm.generate(prompt, gated, use_tqdm=False)[0].outputs[0]  # its grammar compiled by now
    assert out.finish_reason == "stop" and out.token_ids == reference.token_ids
    check(spec, out.text)


def test_schemas_only_llguidance_enforces_whole_go_to_it_under_auto(smollm2_llm):
    """minLength/maxLength beside a pattern or a format: xgrammar's grammar would leave the lengths out, so backend
    auto (the engine's default) has llguidance enforce them; every sample is valid, greedy and sampled."""
    specs = [StructuredOutputsParams(json=CODE), StructuredOutputsParams(json=SITE)]
    assert [smollm2_llm.engine.input_processor.check_structured_outputs(spec).backend
            for spec in specs] == ["guidance"] * 2
    ask = [{"role": "user", "content": "Give a short product code and the company's website as JSON."}]
    params = [SamplingParams(temperature=t, seed=seed, n=n, max_tokens=60, structured_outputs=spec)
              for spec in specs for t, seed, n in ((0.0, None, 1), (1.0, 7, 2))]
    outs = smollm2_llm.chat([ask] * len(params), params, use_tqdm=False)
    for param, out in zip(params, outs):
        for sample in out.outputs:
            assert sample.finish_reason == "stop", sample
            check(param.structured_outputs, sample.text)


def test_structured_outputs_config_options_shape_the_json(smollm2_llm, monkeypatch):
    """structured_outputs_config's disable_any_whitespace and disable_additional_properties, the engine's (as
    LLM(structured_outputs_config=...) sets them) for the specs that leave them unset, a spec's own otherwise."""
    monkeypatch.setattr(smollm2_llm.engine.input_processor, "structured_outputs",
                        StructuredOutputsConfig(disable_any_whitespace=False, disable_additional_properties=True))
    person = {key: value for key, value in PERSON.items() if key != "additionalProperties"}  # silent on others
    ask = [{"role": "user", "content": "Describe a fictional person as JSON with a name, an age, a city and a job."}]
    specs = [StructuredOutputsParams(json=person, backend="xgrammar"), StructuredOutputsParams(json=person,
                                                                                               backend="guidance"),
             StructuredOutputsParams(json=person, backend="guidance", disable_additional_properties=False)]
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec) for spec in specs]
    texts = []
    for out in smollm2_llm.chat([ask] * len(specs), params, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0]
        jsonschema.validate(json.loads(out.outputs[0].text), person)
        texts.append(out.outputs[0].text)
    by_xgrammar, by_llguidance, loose = texts
    # Whitespace is free (the model indents), and both backends keep to the named properties.
    for text in (by_xgrammar, by_llguidance):
        assert "\n" in text and set(json.loads(text)) == {"name", "age"}, text
    # Without disable_additional_properties, llguidance lets the model add the city and job it was asked for.
    assert set(json.loads(loose)) > {"name", "age"}, loose


def test_the_guidance_backend_enforces_regexes_choices_and_grammars(smollm2_llm):
    params = [SamplingParams(temperature=t, seed=5, max_tokens=60, structured_outputs=spec)
              for spec in GUIDED for t in (0.0, 0.9)]
    for param, out in zip(params, smollm2_llm.chat([ASK] * len(params), params, use_tqdm=False)):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0]
        check(param.structured_outputs, out.outputs[0].text)
    cut = smollm2_llm.chat(ASK, SamplingParams(temperature=0, max_tokens=2, structured_outputs=GUIDED[0]),
                           use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 2 and re.match(r"(yes|no)", cut.text)


def test_max_tokens_inside_the_structure_ends_with_length_and_logprobs_are_finite(smollm2_llm):
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=2, structured_outputs=SPECS[0])
    out = smollm2_llm.chat(ASK, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith("{")
    for position, token in zip(out.logprobs, out.token_ids):
        assert position[token].logprob > float("-inf")


def test_bad_specs_fail_before_anything_is_scheduled(smollm2_llm):
    for bad, match in [(StructuredOutputsParams(json='{"type": '), "not valid JSON"),
                       (StructuredOutputsParams(regex="(abc"), "invalid regex"),
                       (StructuredOutputsParams(grammar="root ::= "), "invalid grammar"),
                       (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}),
                        r"uniqueItems at #.*nor can llguidance.*Unimplemented keys: \[\"uniqueItems"),
                       (StructuredOutputsParams(regex="(abc", backend="guidance"), "invalid regex for the guidance"),
                       (StructuredOutputsParams(json={"not": {}}, backend="guidance"), "Unimplemented keys")]:
        with pytest.raises(ValueError, match=match):
            smollm2_llm.generate("Hi", SamplingParams(structured_outputs=bad), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    # Past the structure's end its grammar allows nothing but EOS: these would emit tokens outside it.
    for fields in (dict(ignore_eos=True), dict(min_tokens=8)):
        with pytest.raises(ValueError, match=f"{next(iter(fields))} cannot be combined with structured outputs"):
            smollm2_llm.generate("Hi", SamplingParams(structured_outputs=SPECS[3], **fields), use_tqdm=False)


@pytest.mark.parametrize("engine", ["smollm2_llm", "busy_llm"])
def test_bans_that_leave_a_grammar_no_token_end_that_request_with_error(engine, request):
    """allowed_token_ids that hold "Paris" but not EOS: the choice's grammar then allows only EOS, which the request
    bans, so it ends there ("error", its tokens before kept) instead of emitting a token outside both; a request
    banned from the first token ends with none. The batch's other request is untouched. In the engine's process
    and with a grammar process under async scheduling (busy_llm)."""
    smollm2_llm = request.getfixturevalue(engine)
    paris = smollm2_llm.get_tokenizer().encode("Paris", add_special_tokens=False)
    choice = StructuredOutputsParams(choice=CHOICES)
    params = [SamplingParams(temperature=0, max_tokens=20, structured_outputs=choice, allowed_token_ids=paris),
              SamplingParams(temperature=0, max_tokens=20, structured_outputs=choice),
              SamplingParams(temperature=0.8, seed=1, max_tokens=20, structured_outputs=choice, allowed_token_ids=[0])]
    banned, free, dead = (out.outputs[0] for out in smollm2_llm.chat([ASK] * 3, params, use_tqdm=False))
    assert (banned.finish_reason, banned.token_ids, banned.text) == ("error", paris, "Paris")
    assert free.finish_reason == "stop" and free.text in CHOICES
    assert (dead.finish_reason, dead.token_ids) == ("error", [])


@pytest.mark.parametrize("engine", ["smollm2_llm", "busy_llm"])
def test_a_grammar_that_allows_no_token_ends_its_request_with_error(engine, request):
    """After "a" this grammar allows nothing (an empty character class): its all-zero mask left the draw token 0,
    which the grammar refused, every step to max_tokens ("length"). Its request ends there now, the tokens before
    kept; the batch's other request is untouched. In the engine's process and in a grammar process."""
    llm = request.getfixturevalue(engine)
    dead_end = StructuredOutputsParams(grammar='root ::= "a" [^\\0-\\U0010ffff]')
    params = [SamplingParams(temperature=0, max_tokens=20, structured_outputs=dead_end),
              SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=CHOICES))]
    stuck, free = (out.outputs[0] for out in llm.chat([ASK] * 2, params, use_tqdm=False))
    a = llm.get_tokenizer().encode("a", add_special_tokens=False)
    assert (stuck.finish_reason, stuck.token_ids) == ("error", a)
    assert free.finish_reason == "stop" and free.text in CHOICES


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_drafting_request_whose_grammar_allows_no_token_ends_with_error(smollm2_path, async_scheduling,
                                                                         unmeasured_step_cost):
    """The dead-end grammar above on a request that drafts (n-gram drafts from its prompt of "a"s): its mask after
    "a" allows nothing, so the token a verifying step emits there was drawn from nothing. It ends the request
    ("error", the tokens before kept), as for a request without drafts; before, drafting rows were not checked and
    it ran on to max_tokens. The request beside it is untouched."""
    llm = LLM(smollm2_path, max_model_len=512, kv_cache_space=0.1, dtype="float32", gguf_dequantize=True,
              async_scheduling=async_scheduling,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    from test_spec_decode import always_draft

    always_draft(llm)
    a_lot = [{"role": "user", "content": "a a a a a a a a a a a a"}]
    dead_end = StructuredOutputsParams(grammar='root ::= "a" [^\\0-\\U0010ffff]')
    params = [SamplingParams(temperature=0, max_tokens=20, structured_outputs=dead_end),
              SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=CHOICES))]
    stuck, free = (out.outputs[0] for out in llm.chat([a_lot, ASK], params, use_tqdm=False))
    # (Before: [a, 0, ...], token 0 drawn from nothing; its text is empty, so the ids are compared.)
    a = llm.get_tokenizer().encode("a", add_special_tokens=False)
    assert (stuck.finish_reason, stuck.token_ids) == ("error", a)
    assert free.finish_reason == "stop" and free.text in CHOICES
    assert llm.engine.last_stats.spec_decoding.num_draft_tokens > 0


def test_constrained_requests_draft_and_verify_exactly(smollm2_path, smollm2_llm, monkeypatch, unmeasured_step_cost):
    """Speculation on a constrained request: the grammar masks every draft position, and the tokens are
    exactly those of the same request without speculation (its matchers in a grammar process, the plain
    engine's, smollm2_llm's, in its own process)."""
    monkeypatch.setattr("tokenmill.structured.matchers.use_grammar_process", lambda device: True)
    # float32 and dequantized, as smollm2_llm: the tokens must equal plain decoding's exactly (bfloat16 rounds a
    # verify step differently).
    # The engine's backend guidance (llguidance's matchers walk the drafts and roll back as xgrammar's do), and
    # requests that name xgrammar.
    llm = LLM(smollm2_path, max_model_len=512, kv_cache_space=0.1, dtype="float32", gguf_dequantize=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2},
              structured_outputs_config={"backend": "guidance"})
    budget = llm.engine.core.scheduler.draft_budget
    budget.cost, budget.min_gain = None, 0.0  # draft every step, whatever the measured step cost says
    copy = [{"role": "user", "content": 'Repeat this JSON exactly: {"name": "Alice Smith", "age": 30}'}]
    by_xgrammar = [dataclasses.replace(spec, backend="xgrammar") for spec in (SPECS[0], SPECS[2])]
    specs = [*by_xgrammar, SPECS[0], SPECS[2]]
    assert llm.engine.input_processor.structured_outputs == StructuredOutputsConfig(backend="guidance")
    backends = [llm.engine.input_processor.check_structured_outputs(spec).backend for spec in specs]
    assert backends == ["xgrammar"] * 2 + ["guidance"] * 2
    asks = [copy, ASK] * 2
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec) for spec in specs]
    outs = llm.chat(asks, params, use_tqdm=False)
    for spec, out in zip(specs, outs):
        check(spec, out.outputs[0].text)
    stats = llm.engine.last_stats.spec_decoding
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, stats
    assert not llm.engine.core.executor.driver_worker.model_runner.grammar_rows.in_process
    assert smollm2_llm.engine.core.executor.driver_worker.model_runner.grammar_rows.in_process
    # Compiled once, in the grammar process, which told the engine core when each was ready.
    assert llm.engine.core.awaiting_grammar.compiler.num_compiled == 0
    # The same backends in smollm2_llm (whose default is auto).
    plain = [*by_xgrammar, *(dataclasses.replace(spec, backend="guidance") for spec in (SPECS[0], SPECS[2]))]
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec) for spec in plain]
    expected = smollm2_llm.chat(asks, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]


# A draft tree (speculative_token_tree) of depth 3, as test_spec_decode.py's.
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0)]


def write_random_eagle_head(folder, target) -> str:
    """A seeded random one-layer EAGLE-1 head (config.json, pytorch_model.bin) of the `target` config's width."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                         intermediate_size=target.intermediate_size, num_hidden_layers=1,
                         num_attention_heads=target.num_attention_heads,
                         num_key_value_heads=target.num_key_value_heads,
                         max_position_embeddings=target.max_position_embeddings)
    config.save_pretrained(folder)
    tensors = {f"layers.0.{n}": t for n, t in LlamaDecoderLayer(config, 0).state_dict().items()
               if not n.startswith("input_layernorm.")}
    tensors["fc.weight"] = torch.randn(target.hidden_size, 2 * target.hidden_size) * 0.02
    torch.save(tensors, folder / "pytorch_model.bin")
    return str(folder)


def test_constrained_requests_verify_an_eagle_heads_chain_exactly(smollm2_path, smollm2_llm, tmp_path,
                                                                unmeasured_step_cost):
    """An EAGLE head drafts each next chain right after the verification (spec/eagle.py draft_after_verify); the
    grammar masks every draft position of it: greedy tokens are those of the same requests without speculation."""
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec) for spec in SPECS[:4]]
    plain = smollm2_llm.chat([ASK] * 4, params, use_tqdm=False)
    target = smollm2_llm.engine.core.executor.driver_worker.hf_config
    spec = {"method": "eagle", "model": write_random_eagle_head(tmp_path, target), "num_speculative_tokens": 3}
    llm = LLM(smollm2_path, max_model_len=512, kv_cache_space=0.1, dtype="float32", gguf_dequantize=True,
              speculative_config=spec)
    from test_spec_decode import always_draft

    always_draft(llm)
    outs = llm.chat([ASK] * 4, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.last_stats.spec_decoding.num_draft_tokens > 0


def test_eagle_steps_launched_ahead_beside_constrained_requests_change_no_token(smollm2_path, smollm2_llm, tmp_path,
                                                                                 monkeypatch, unmeasured_step_cost):
    """Async scheduling with an EAGLE head: once the constrained request ends, the others' verifying steps launch
    before the last one's tokens reach the host (worker/verify_ahead.py) in an engine with a grammar process;
    greedy tokens are those of the same requests without speculation."""
    monkeypatch.setattr("tokenmill.structured.matchers.use_grammar_process", lambda device: True)
    params = [SamplingParams(temperature=0, max_tokens=10, structured_outputs=SPECS[0])] + [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) for _ in range(2)]
    plain = smollm2_llm.chat([ASK] * 3, params, use_tqdm=False)
    target = smollm2_llm.engine.core.executor.driver_worker.hf_config
    spec = {"method": "eagle", "model": write_random_eagle_head(tmp_path, target), "num_speculative_tokens": 3}
    llm = LLM(smollm2_path, max_model_len=512, kv_cache_space=0.1, dtype="float32", gguf_dequantize=True,
              speculative_config=spec, async_scheduling=True)
    from test_spec_decode import always_draft

    always_draft(llm)
    runner = llm.engine.core.executor.driver_worker.model_runner
    assert not runner.grammar_rows.in_process
    take_drafts_ahead, launched_ahead = runner.speculative.take_drafts_ahead, [0]

    def counting(ahead):
        launched_ahead[0] += 1
        return take_drafts_ahead(ahead)

    runner.speculative.take_drafts_ahead = counting
    outs = llm.chat([ASK] * 3, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert launched_ahead[0] > 3, launched_ahead


def test_constrained_requests_draft_trees_and_verify_exactly(smollm2_path, smollm2_llm, tmp_path, monkeypatch,
                                                            capfd, unmeasured_step_cost):
    """Draft trees on constrained requests: the grammar masks the logits row of every node (with its path
    accepted), so greedy tokens are exactly those of the same requests without speculation (smollm2_llm, its
    matchers in its own process; here in a grammar process), and a sampled request obeys its spec. The trees
    are scripted around the plain run's continuation (test_spec_decode.py's ScriptedTreeProposer: the right
    token under a different branch each step, wrong ones beside it that the grammar often refuses); the head,
    random, only makes the engine draft trees."""
    from test_spec_decode import ScriptedTreeProposer, record_accepted_paths, use_scripted_proposer

    from tokenmill.config import parse_token_tree
    from tokenmill.spec.tree import TokenTree
    from tokenmill.worker import tree_verify

    copy = [{"role": "user", "content": 'Repeat this JSON exactly: {"name": "Alice Smith", "age": 30}'}]
    asks, specs = [copy, ASK, ASK], [SPECS[0], SPECS[2], SPECS[3]]  # a JSON schema, a regex, a choice
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec) for spec in specs]
    plain = smollm2_llm.chat(asks, params, use_tqdm=False)
    target = smollm2_llm.engine.core.executor.driver_worker.hf_config
    monkeypatch.setattr("tokenmill.structured.matchers.use_grammar_process", lambda device: True)
    spec = {"method": "eagle", "model": write_random_eagle_head(tmp_path, target), "num_speculative_tokens": 3,
            "speculative_token_tree": TREE}
    llm = LLM(smollm2_path, max_model_len=512, kv_cache_space=0.1, dtype="float32", gguf_dequantize=True,
              speculative_config=spec)
    sequences = [o.prompt_token_ids + list(o.outputs[0].token_ids) for o in plain]
    use_scripted_proposer(llm, ScriptedTreeProposer(sequences, TokenTree.from_paths(parse_token_tree(TREE))))
    monkeypatch.setattr(tree_verify, "verify_tree", tree_verify.verify_tree)  # restored after the recording below
    accepted_nodes = record_accepted_paths(llm)
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=60, structured_outputs=SPECS[0])
    outs = llm.chat(asks + [copy], params + [sampled], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:3]] == [o.outputs[0].token_ids for o in plain]
    for spec, out in zip(specs + [SPECS[0]], outs):
        check(spec, out.outputs[0].text)
    stats = llm.engine.last_stats.spec_decoding
    assert stats.num_draft_tokens > 0 and stats.accepted_per_position[2] > 0, stats  # trees drafted, deep paths taken
    assert stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert {0, 1}.issubset(path[0] for path in accepted_nodes)  # both of the root's branches were taken
    assert not llm.engine.core.executor.driver_worker.model_runner.grammar_rows.in_process
    # Nodes past an accepted stop token may be accepted too (its mask allows all): never handed to the grammar.
    assert "refused" not in capfd.readouterr().err


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_requests_left_no_token_beside_drafting_ones_end_with_error_alone(smollm2_path, smollm2_llm,
                                                                          async_scheduling, unmeasured_step_cost):
    """Requests that cannot draft (a grammar with bans; bad_words) share verifying steps with one that drafts. Their
    one position was not checked for a token left there (the draw emitted token 0, outside their bans and grammar);
    and the -1 that marks such a row reached the next step's inputs on the host (an IndexError that failed the
    engine; a device assert on a GPU)."""
    copy = [{"role": "user", "content": "Repeat after me: one two three one two three one two three"}]
    zero = smollm2_llm.get_tokenizer().encode("0", add_special_tokens=False)  # "00" is [zero, zero]
    paris = smollm2_llm.get_tokenizer().encode("Paris", add_special_tokens=False)
    params = [SamplingParams(temperature=0, max_tokens=30),
              SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=CHOICES),
                             allowed_token_ids=paris),
              SamplingParams(temperature=0, max_tokens=20, allowed_token_ids=zero, bad_words=["00"], ignore_eos=True)]
    expected = smollm2_llm.chat(copy, params[0], use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(smollm2_path, max_model_len=512, kv_cache_space=0.1, dtype="float32", gguf_dequantize=True,
              async_scheduling=async_scheduling,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    from test_spec_decode import always_draft

    always_draft(llm)
    free, constrained, banned = (out.outputs[0] for out in llm.chat([copy, ASK, ASK], params, use_tqdm=False))
    assert free.token_ids == expected
    assert (constrained.finish_reason, constrained.token_ids) == ("error", paris)
    assert (banned.finish_reason, banned.token_ids) == ("error", zero)
    assert llm.engine.last_stats.spec_decoding.num_accepted_tokens > 0
