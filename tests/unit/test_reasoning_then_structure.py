"""A constrained output that thinks first (issue 18): with a reasoning parser, the constraint applies only after
"</think>". The composed grammar checked with xgrammar's matcher on strings (free text, the marker, then only
what the structure takes); the server's plan (which requests think first, which start constrained); and a forced
call's text split into reasoning_content and tool_calls, whole and streamed alike."""

from __future__ import annotations

import json

import pytest

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.server.config import ServerConfig
from tokenmill.server.openai_protocol import ChatCompletionRequest
from tokenmill.server.reasoning_parsers import get_reasoning_parser
from tokenmill.server.structured_outputs import constraint_of
from tokenmill.server.tools import ChoiceText, plan_tools, reasoning_parser_of, think_first
from tokenmill.structured.grammar import build_grammar

ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}


def matcher(params: StructuredOutputsParams):
    import xgrammar as xgr

    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(build_grammar(params))
    return xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)


def accepts(params: StructuredOutputsParams, text: str) -> bool:
    m = matcher(params)
    return m.accept_string(text) and m.is_terminated()


def test_free_text_then_marker_then_only_the_schema():
    params = StructuredOutputsParams(json=ANSWER, reasoning_end="</think>")
    assert accepts(params, 'Two and two make four.</think>{"answer": 4}')
    assert accepts(params, '<think>hmm</think>\n\n{"answer": 4}')
    assert accepts(params, '</think>{"answer": 4}')  # an empty reasoning
    # JSON before the marker is just text, and JSON the schema refuses is fine there too.
    assert accepts(params, '{"answer": 4} or {"answer": "four"}? </think>{"answer": 4}')
    # Not done before the marker and the JSON; after the marker, only the schema's JSON.
    m = matcher(params)
    assert m.accept_string('{"answer": 4}') and not m.is_terminated()
    assert not accepts(params, '{"answer": 4}')
    assert not accepts(params, 'So: </think>{"answer": "four"}')
    assert not accepts(params, 'So: </think>The answer is 4.')
    assert not accepts(params, 'So: </think>{"answer": 4} and more')
    assert not accepts(params, 'So: </think>\n\n\n{"answer": 4}')  # at most two newlines after the marker
    # Without reasoning_end, the schema applies from the first character.
    assert accepts(StructuredOutputsParams(json=ANSWER), '{"answer": 4}')
    assert not accepts(StructuredOutputsParams(json=ANSWER), 'x</think>{"answer": 4}')


@pytest.mark.parametrize("special", [False, True], ids=["added", "special"])
def test_a_marker_that_is_one_token_ends_the_reasoning(special):
    """Qwen3's and DeepSeek-R1's "</think>" is one added token: the mask allows it while thinking (the model can end
    its reasoning with it) and only the structure after it, with the real tokenizer's vocabulary."""
    from pathlib import Path

    import xgrammar as xgr
    from tokenizers import AddedToken
    from transformers import AutoTokenizer
    from xgrammar.testing import _get_masked_tokens_from_bitmask

    root = Path(__file__).resolve().parents[2]
    tokenizer = AutoTokenizer.from_pretrained(root / "benchmarks/models/smollm2-tokenizer")
    tokenizer.add_tokens([AddedToken(t, special=special) for t in ("<think>", "</think>")], special_tokens=special)
    end, brace, word = tokenizer.convert_tokens_to_ids(["</think>", "{", "Hello"])
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiled = xgr.GrammarCompiler(info).compile_grammar(build_grammar(StructuredOutputsParams(json=ANSWER,
                                                                                               reasoning_end="</think>")))
    m, bitmask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, info.vocab_size)

    def banned() -> set[int]:
        m.fill_next_token_bitmask(bitmask)
        return set(_get_masked_tokens_from_bitmask(bitmask, info.vocab_size))

    assert m.accept_string("Two and two make four.") and not {end, word} & banned()
    assert m.accept_token(end) and brace not in banned() and {word, end} <= banned()


@pytest.mark.parametrize("special", [False, True], ids=["text", "special"])
def test_guidance_thinks_first_too(special):
    """The guidance backend's (llguidance's) grammar after reasoning: free text (JSON-looking or not), the marker
    (as text, or one special token of the tokenizer's), at most two newlines, then only the structure."""
    from pathlib import Path

    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from tokenmill.structured.guidance import compile_guidance, is_special_end, make_tokenizer

    llguidance = pytest.importorskip("llguidance")
    root = Path(__file__).resolve().parents[2]
    tokenizer = AutoTokenizer.from_pretrained(root / "benchmarks/models/smollm2-tokenizer")
    if special:
        tokenizer.add_tokens([AddedToken("</think>", special=True)], special_tokens=True)
    lt = make_tokenizer(tokenizer, len(tokenizer))
    params = StructuredOutputsParams(json=ANSWER, reasoning_end="</think>", backend="guidance")
    assert is_special_end(params, lt, tokenizer) == special
    compiled = compile_guidance(params, lt, special)

    def takes(text: str) -> bool:
        ids = tokenizer.encode(text, add_special_tokens=False)
        m = llguidance.LLMatcher(lt, compiled.grammar, log_level=0)
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()

    assert takes('{"answer": 4} or {"answer": "four"}? </think>{"answer":4}')
    assert takes('</think>\n\n{"answer":4}')
    assert not takes('{"answer":4}')
    assert not takes('So: </think>{"answer":"four"}')
    assert not takes('So: </think>\n\n\n{"answer":4}')


@pytest.mark.parametrize("special", [False, True], ids=["text", "special"])
def test_a_model_that_opens_its_own_block_is_constrained_when_it_opens_none(special):
    """reasoning_start (qwen3, glm45, granite, mistral: the model thinks only in a block it opens itself): an output
    opening no block is the structure from its first token; before, the structure waited for a "</think>" that
    never came and such an output was not constrained at all (Granite answering without "thinking": free text).
    xgrammar, and llguidance with the markers as text or as special tokens."""
    from pathlib import Path

    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from tokenmill.structured.guidance import compile_guidance, make_tokenizer

    llguidance = pytest.importorskip("llguidance")
    root = Path(__file__).resolve().parents[2]
    tokenizer = AutoTokenizer.from_pretrained(root / "benchmarks/models/smollm2-tokenizer")
    if special:
        tokenizer.add_tokens([AddedToken(t, special=True) for t in ("<think>", "</think>")], special_tokens=True)
    lt = make_tokenizer(tokenizer, len(tokenizer))
    compiled = compile_guidance(StructuredOutputsParams(json=ANSWER, reasoning_end="</think>",
                                                        reasoning_start="<think>", backend="guidance"), lt, special)

    def guidance_takes(text: str) -> bool:
        ids = tokenizer.encode(text, add_special_tokens=False)
        m = llguidance.LLMatcher(lt, compiled.grammar, log_level=0)
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()

    params = StructuredOutputsParams(json=ANSWER, reasoning_end="</think>", reasoning_start="<think>")
    for takes, answer in ((lambda text: accepts(params, text), '{"answer": 4}'), (guidance_takes, '{"answer":4}')):
        assert takes(answer)  # no block: the structure at once
        assert takes("<think>Two and {two}.</think>\n" + answer) and takes("\n<think>hm</think>" + answer)
        assert not takes("Four.") and not takes("The answer: " + answer)  # unopened text is not reasoning
        assert not takes("Four.</think>" + answer) and not takes("<think>Four.</think>Four.")
    with pytest.raises(ValueError, match="reasoning_start"):
        StructuredOutputsParams(regex="a", reasoning_start="<think>")


@pytest.mark.parametrize("spec, good, bad", [
    ({"regex": "[ab]+"}, "abba", "abc"),
    ({"choice": ["yes", "no"]}, "no", "maybe"),
    ({"json_object": True}, '{"a": 1}', "[1]"),
])
def test_other_kinds_compose(spec, good, bad):
    params = StructuredOutputsParams(**spec, reasoning_end="</think>")
    assert accepts(params, f"{bad} {good}</think>{good}")
    assert not accepts(params, f"{good}</think>{bad}")


def test_reasoning_end_is_part_of_the_key_of_the_compiled_grammar():
    from tokenmill.structured.compiler import GrammarCompiler

    compiler = GrammarCompiler(lambda: None, 0)
    try:
        plain = StructuredOutputsParams(regex="a")
        thinking = StructuredOutputsParams(regex="a", reasoning_end="</think>")
        # Distinct cache entries (the futures fail here: there is no tokenizer to compile against).
        assert compiler.submit(plain) is not compiler.submit(thinking)
        assert compiler.submit(thinking) is compiler.submit(thinking)
    finally:
        compiler.shutdown()
    with pytest.raises(ValueError, match="reasoning_end"):
        StructuredOutputsParams(regex="a", reasoning_end="")


def request(**kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kwargs})


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_plan(parser):
    config = ServerConfig(reasoning_parser=parser)
    req = request(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}})
    constraint = constraint_of(req)
    # The template opened the think block, or left it to the model: think first.
    for prompt in ("<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n"):
        reasoning = reasoning_parser_of(config, prompt)
        assert issubclass(reasoning, get_reasoning_parser(parser))  # opened: qwen3's variant that starts inside
        assert think_first(constraint, reasoning).params.reasoning_end == "</think>"
    # enable_thinking=false: the template closed it; constrained from the start, nothing is reasoning.
    reasoning = reasoning_parser_of(config, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert reasoning is None and think_first(constraint, reasoning).params.reasoning_end is None
    # No reasoning parser: as before.
    assert reasoning_parser_of(ServerConfig(), "<think>\n") is None


@pytest.mark.parametrize("parser", ["qwen3", "granite", "mistral"])
def test_parsers_of_self_opened_blocks_constrain_an_output_that_opens_none(parser):
    """The server's plan for a parser that takes an unopened output for content: a response_format, and strict
    tools' tag under "auto", apply from the first token unless the output opens the parser's block."""
    reasoning = reasoning_parser_of(ServerConfig(reasoning_parser=parser), "<|im_start|>assistant\n")
    start, end = reasoning.starts[0], reasoning.ends[0]
    req = request(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}})
    params = think_first(constraint_of(req), reasoning).params
    assert (params.reasoning_start, params.reasoning_end) == (start, end)
    assert accepts(params, '{"answer": 4}') and accepts(params, f'{start}Add.{end}{{"answer": 4}}')
    assert not accepts(params, "It is 4.")
    tool = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}}
    config = ServerConfig(reasoning_parser=parser, enable_auto_tool_choice=True, tool_call_parser="hermes")
    tag = think_first(plan_tools(request(tools=[tool]), config, False).constraint, reasoning).params
    good, bad = '{"name": "get_weather", "arguments": {"city": "Paris"}}', '{"name": "get_weather", "arguments": {}}'
    assert accepts(tag, f"Sure.<tool_call>\n{good}\n</tool_call>")
    assert not accepts(tag, f"Sure.<tool_call>\n{bad}\n</tool_call>")  # unopened: the call is constrained
    assert accepts(tag, f"{start}<tool_call>\n{bad} is a bad call.{end}Sure.")  # inside the block: free text
    assert accepts(tag, f"{start}Hm.{end}<tool_call>\n{good}\n</tool_call>")
    assert not accepts(tag, f"{start}Hm.{end}<tool_call>\n{bad}\n</tool_call>")


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_prompt_that_closed_the_think_block_leaves_the_answer_as_content(parser):
    # DeepSeek-V3.1's template with thinking=false, Qwen3's with enable_thinking=false: the output is the answer.
    config = ServerConfig(reasoning_parser=parser)
    for prompt in ("<｜Assistant｜></think>", "<|im_start|>assistant\n<think>\n\n</think>\n\n"):
        reasoning = reasoning_parser_of(config, prompt)
        text = ChoiceText(plan_tools(request(), config, False), reasoning)
        assert text.full("Paris.") == {"content": "Paris."}


def streamed(text: ChoiceText, pieces: list[str]) -> dict:
    reasoning, calls = "", {}
    for delta in [text.feed(piece) for piece in pieces] + [text.finish()]:
        assert not delta.get("content")
        reasoning += delta.get("reasoning_content") or ""
        for entry in delta.get("tool_calls", []):
            call = calls.setdefault(entry["index"], ["", ""])
            call[0] = entry["function"].get("name") or call[0]
            call[1] += entry["function"].get("arguments", "")
    return {"reasoning_content": reasoning, "calls": [tuple(calls[i]) for i in sorted(calls)]}


@pytest.mark.parametrize("cut", [1, 3, 7, 50])
def test_forced_call_after_reasoning_whole_equals_streamed(cut):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    plan = plan_tools(request(tools=[tool], tool_choice="required"), ServerConfig(), False)
    reasoning = get_reasoning_parser("deepseek_r1")
    output = ('They ask about Paris: {"name": "x"} is not it.</think>\n\n'
              '[{"name": "get_weather", "parameters": {"city": "Paris"}}]')
    text = ChoiceText(plan, reasoning)
    message = text.full(output)
    assert message["reasoning_content"] == 'They ask about Paris: {"name": "x"} is not it.'
    assert message["content"] is None and text.finish_reason("stop") == "tool_calls"
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    pieces = [output[i:i + cut] for i in range(0, len(output), cut)]
    assert streamed(ChoiceText(plan, reasoning), pieces) == {
        "reasoning_content": message["reasoning_content"],
        "calls": [("get_weather", call["function"]["arguments"])]}


@pytest.mark.parametrize("parser", ["qwen3", "glm45"])
def test_a_prompt_that_opened_the_think_block_streams_as_it_splits(parser):
    """Qwen3 Thinking-2507's template opens <think> in the prompt (its output has only </think>): served with
    --reasoning-parser qwen3, a stream sent all of it as content, "</think>" included, where the whole response
    split off the reasoning; a forced call's stream then read the reasoning as the call's JSON (finish_reason "stop",
    not "tool_calls"). Now such a prompt starts the parser inside the block, streamed and whole, as the usage's
    reasoning_tokens and thinking_token_budget count it; cut while thinking, the text is reasoning."""
    config = ServerConfig(reasoning_parser=parser)
    reasoning = reasoning_parser_of(config, "<|im_start|>assistant\n<think>\n")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    forced = plan_tools(request(tools=[tool], tool_choice="required"), config, False)
    call = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    for plan, output in ((plan_tools(request(), config, False), 'Add them.</think>\n\n{"answer": 4}'),
                         (plan_tools(request(), config, False), "Add them, then"),  # cut by max_tokens
                         (forced, "Paris, then.</think>\n" + call)):
        text = ChoiceText(plan, reasoning)
        message = text.full(output)
        assert message["reasoning_content"] == output.split("</think>")[0], message
        streamed_text = ChoiceText(plan, reasoning)
        deltas = [streamed_text.feed(piece) for piece in output] + [streamed_text.finish()]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
        assert ("".join(d.get("content") or "" for d in deltas) or None) == message["content"]
        assert streamed_text.finish_reason("stop") == text.finish_reason("stop")
    assert message["tool_calls"] and text.finish_reason("stop") == "tool_calls"
    # A prompt that leaves the block to the model: an output with no </think> is all content, as before.
    unopened = reasoning_parser_of(config, "<|im_start|>assistant\n")
    assert ChoiceText(plan_tools(request(), config, False), unopened).full("Hi.") == {
        "content": "Hi.", "reasoning_content": None}


def test_a_forced_call_cut_while_thinking_with_qwen3_is_not_an_error():
    """Qwen3's parser gives an output without </think> (max_tokens cut the thinking) as content, so the forced
    call's reader reads free text: a JSON-looking string in it that is not JSON ("c:\\path") raised (a 500)."""
    tool = {"type": "function", "function": {"name": "get_weather"}}
    plan = plan_tools(request(tools=[tool], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                      ServerConfig(), False)
    text = ChoiceText(plan, get_reasoning_parser("qwen3"))
    output = '<think>They want {"c:\\path": 1} and'
    assert text.full(output) == {"content": output, "reasoning_content": None}
    assert text.finish_reason("length") == "length"


def test_each_parser_thinks_first_up_to_its_own_marker():
    """Magistral's [/THINK] and Granite's "Here is my response:" end the free text, not </think>."""
    req = request(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}})
    constraint = constraint_of(req)
    for parser, thought in (("mistral", '[THINK]{"answer": "?"} maybe</think>[/THINK]'),
                            ("granite", 'Here is my thought process: {"answer": 3}? no. Here is my response:\n')):
        reasoning = reasoning_parser_of(ServerConfig(reasoning_parser=parser), "<s>[INST]2+2?[/INST]")
        params = think_first(constraint, reasoning).params
        assert accepts(params, thought + '{"answer": 4}') and not accepts(params, thought + "4")
        text = ChoiceText(plan_tools(req, ServerConfig(), False), reasoning)
        assert text.full(thought + '{"answer": 4}')["content"].lstrip() == '{"answer": 4}'


def test_deepseek_v3_reasoning_follows_the_requests_thinking_switch():
    """--reasoning-parser deepseek_v3: thinking on in chat_template_kwargs (DeepSeek-V3.1's template then opens
    <think> in the prompt) splits as deepseek_r1 and thinks first; off (the default) the output is all content,
    constrained from the first token."""
    config = ServerConfig(reasoning_parser="deepseek_v3")
    req = request(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}})
    on = reasoning_parser_of(config, "<｜User｜>2+2?<｜Assistant｜><think>", {"thinking": True})
    assert on is get_reasoning_parser("deepseek_r1")
    assert think_first(constraint_of(req), on).params.reasoning_end == "</think>"
    for kwargs in (None, {}, {"thinking": False}):
        off = reasoning_parser_of(config, "<｜User｜>2+2?<｜Assistant｜></think>", kwargs)
        assert off is None and think_first(constraint_of(req), off).params.reasoning_end is None
        assert ChoiceText(plan_tools(request(), config, False), off).full("4, no </think> here") == {
            "content": "4, no </think> here"}
    text = ChoiceText(plan_tools(request(), config, False), on)
    assert text.full("Add them.</think>4") == {"reasoning_content": "Add them.", "content": "4"}


def test_the_reasoning_parser_sees_the_template_variables_the_template_sees():
    """reasoning_effort turns enable_thinking on for the template; deepseek_v3's parser must read the same variables,
    the server's --default-chat-template-kwargs under the request's included."""
    from types import SimpleNamespace

    from tokenmill.server.serving_chat import template_variables

    prompt = "<｜User｜>2+2?<｜Assistant｜><think>"
    plain = SimpleNamespace(config=ServerConfig(reasoning_parser="deepseek_v3"))
    effort = request(reasoning_effort="high")
    assert template_variables(plain, effort)["enable_thinking"] is True
    assert reasoning_parser_of(plain.config, prompt, template_variables(plain, effort)) is get_reasoning_parser(
        "deepseek_r1")
    thinking = SimpleNamespace(config=ServerConfig(reasoning_parser="deepseek_v3",
                                                   default_chat_template_kwargs={"thinking": True}))
    assert reasoning_parser_of(thinking.config, prompt, template_variables(thinking, request())) is not None
    off = request(chat_template_kwargs={"thinking": False})
    assert reasoning_parser_of(thinking.config, prompt, template_variables(thinking, off)) is None
