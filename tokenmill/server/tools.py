"""Tool calling and reasoning on /v1/chat/completions: what a request's tools and tool_choice mean, and the
model's text turned into message (or delta) fields: reasoning_content, content and tool_calls.

tool_choice decides how calls come out:
- "none": tools reach the chat template, nothing is parsed;
- "required" or a named function: generated under a JSON schema (structured outputs) of the call(s), whose
  JSON becomes tool_calls; the model's own format is never seen, so any model can do it;
- "auto" (the default with tools): the model writes calls its own way, which --tool-call-parser reads back;
  it needs the server's --enable-auto-tool-choice, as in vLLM. Functions marked strict have their arguments
  enforced once the model starts a call (a structural tag in the parser's format; the text stays free), as
  OpenAI's strict does; a parser whose format has no structural tag refuses them.

--reasoning-parser splits the reasoning off first; what is left is the content, which the tool parser reads.
A constrained output (tool calls forced, response_format, structured outputs) may think first, as in vLLM: its
constraint applies only after the parser's end marker ("</think>", "[/THINK]", ...); the text before it is free
and goes to reasoning_content. So does the structural tag of strict tools under "auto": a trigger written while
thinking ("<tool_call>" mentioned) would otherwise force a call into the reasoning. A prompt that already ends
the reasoning (Qwen3's enable_thinking=false writes an empty think block, DeepSeek-V3.1's thinking=false a
"</think>"), or chat_template_kwargs that turn thinking off for the parser (deepseek_v3's `thinking`), turn the
reasoning parser off: the output is the answer, constrained from the start.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.server.config import ServerConfig
from tokenmill.server.errors import bad_request
from tokenmill.server.forced_calls import Scanner, scan
from tokenmill.server.openai_protocol import ChatCompletionRequest
from tokenmill.server.reasoning_parsers import ReasoningParser, get_reasoning_parser
from tokenmill.server.structured_outputs import Constraint
from tokenmill.server.tool_parsers import ToolCall, ToolCallDelta, ToolParser, get_tool_parser

NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]] | None
    """As sent (nulls dropped): for the chat template and the tool parser."""
    mode: str = "none"
    """none | forced | auto."""
    named: str | None = None
    """The one function a named tool_choice forces."""
    parallel: bool = True
    constraint: Constraint | None = None
    """The schema forced calls are generated under; under auto, the structural tag of strict tools."""
    parser: type[ToolParser] | None = None
    """The parser of auto mode."""
    make_id: Callable[[str, int], str] = ToolParser.make_id
    """Forced calls' ids: of the server's tool parser when it has one (Mistral's templates take back 9 characters,
    Kimi-K2's "functions.NAME:IDX")."""
    calls_before: int = 0
    """The calls in the request's assistant messages: this response's first call is the conversation's call number
    `calls_before` (Kimi-K2's ids count the whole conversation's)."""

    def call_id(self, name: str, index: int) -> str:
        """The id of a forced call to `name`, the response's call number `index`."""
        return self.make_id(name, self.calls_before + index)


def _call_schema(tool: dict[str, Any], at: str) -> dict[str, Any]:
    """The schema of one call, {"name": ..., "parameters": {...}}, placed at the JSON pointer `at`."""
    function = tool["function"]
    parameters = _moved(function.get("parameters") or NO_PARAMETERS, f"{at}/properties/parameters")
    return {"type": "object",
            "properties": {"name": {"type": "string", "enum": [function["name"]]}, "parameters": parameters},
            "required": ["name", "parameters"], "additionalProperties": False}


SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
"""Keywords whose value maps names (any text, "enum" too) to schemas."""
DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
"""Keywords whose value is data, not schemas: a "$ref" in it is left alone."""


def _moved(schema: Any, to: str) -> Any:
    """A schema placed at the JSON pointer `to` of a larger one: its local references ("#/$defs/Item", as pydantic
    writes them, or "#") rewritten to point where their targets now are."""
    if isinstance(schema, list):
        return [_moved(item, to) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            value = to + value[1:]
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            value = {name: _moved(sub, to) for name, sub in value.items()}
        elif key not in DATA_KEYWORDS:
            value = _moved(value, to)
        out[key] = value
    return out


def plan_tools(req: ChatCompletionRequest, config: ServerConfig, constrained: bool) -> ToolPlan:
    """What the request's tools ask for; a 400 for what cannot be done. `constrained`: the request has its
    own structured outputs (response_format, ...)."""
    tools = [tool.model_dump(exclude_none=True) for tool in req.tools] if req.tools else None
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return ToolPlan(tools)
    if tools is None:
        raise bad_request("tool_choice other than \"none\" needs tools", param="tool_choice")
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", param="tools")
    if choice == "auto":
        if not (config.enable_auto_tool_choice and config.tool_call_parser):
            raise bad_request("\"auto\" tool choice requires the server to be started with --enable-auto-tool-choice "
                              "and --tool-call-parser NAME; or pass tool_choice \"required\", a named function or "
                              "\"none\"", param="tool_choice")
        parser = get_tool_parser(config.tool_call_parser)
        return ToolPlan(tools, "auto", parallel=req.parallel_tool_calls, parser=parser,
                        constraint=_strict_constraint(tools, parser, req.parallel_tool_calls, constrained))
    if constrained:
        raise bad_request("tool_choice \"required\" or a named function cannot be combined with response_format or "
                          "structured outputs", param="tool_choice")
    if choice == "required":
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {
            "anyOf": [_call_schema(tool, f"#/items/anyOf/{i}") for i, tool in enumerate(tools)]}}
        if not req.parallel_tool_calls:
            schema["maxItems"] = 1
        named = None
    else:
        named = choice.function.name
        if named not in names:
            raise bad_request(f"tool_choice names the function {named!r}, which is not in tools "
                              f"({', '.join(names)})", param="tool_choice")
        schema = _call_schema(tools[names.index(named)], "#")
    try:
        constraint = Constraint(StructuredOutputsParams(json=schema), "tools")
    except ValueError as e:
        raise bad_request(str(e), param="tools") from e
    make_id = get_tool_parser(config.tool_call_parser).make_id if config.tool_call_parser else ToolParser.make_id
    calls_before = sum(len(message.tool_calls or ()) for message in req.messages)
    return ToolPlan(tools, "forced", named=named, parallel=req.parallel_tool_calls, constraint=constraint,
                    make_id=make_id, calls_before=calls_before)


def _strict_constraint(tools: list[dict[str, Any]], parser: type[ToolParser], parallel: bool,
                       constrained: bool) -> Constraint | None:
    """The structural tag that enforces strict tools' arguments under auto, None when no tool is strict."""
    if not any(tool["function"].get("strict") for tool in tools):
        return None
    if parser.strict_trigger is None:
        raise bad_request(f"strict tools with tool_choice \"auto\" are not supported by the {parser.name} tool "
                          f"parser: its calls cannot be enforced with a structural tag; leave strict out, or pass "
                          f"tool_choice \"required\" or a named function", param="tools")
    if constrained:
        raise bad_request("strict tools with tool_choice \"auto\" cannot be combined with response_format or "
                          "structured outputs; leave strict out, or the other", param="tools")
    return Constraint(StructuredOutputsParams(structural_tag=parser.structural_tag(tools, parallel)), "tools",
                      free=True,
                      note=" (in the structural tag made of the strict tools: its format.tags[i] is tools[i])")


def forced_calls(text: str, named: str | None, make_id: Callable[[str, int], str]) -> list[ToolCall]:
    """The calls in the JSON a forced tool_choice generated, each id `make_id(name, index in the response)`; cut
    by max_tokens, the calls begun so far as a stream of the same text sends them (up to the first without its
    name)."""
    raw = scan(text, named is not None)
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    items = [value] if named is not None else value
    if not isinstance(items, list) or not all(isinstance(item, dict) and "name" in item for item in items):
        calls = []
        for call in raw:
            if call.name is None:
                break
            calls.append(ToolCall(make_id(call.name, len(calls)), call.name, call.arguments))
        return calls
    # The arguments as generated (what a stream of the same text sends), "{}" where there were none.
    return [ToolCall(make_id(item["name"], i), item["name"],
                     raw[i].arguments if i < len(raw) and raw[i].complete else
                     json.dumps(item.get("parameters", {}), ensure_ascii=False))
            for i, item in enumerate(items)]


def _call_entries(deltas: list[ToolCallDelta]) -> list[dict]:
    """Deltas as delta.tool_calls entries, a call's head and its arguments in one entry when they come together."""
    entries: list[dict] = []
    for delta in deltas:
        entry = delta.to_openai()
        if delta.name is None and entries and entries[-1]["index"] == delta.index:
            entries[-1]["function"]["arguments"] += entry["function"]["arguments"]
        else:
            entries.append(entry)
    return entries


class ChoiceText:
    """One choice's text -> its message fields (`full`) or its delta fields step by step (`feed`, `finish`)."""

    def __init__(self, plan: ToolPlan, reasoning: type[ReasoningParser] | None, include_reasoning: bool = True) -> None:
        self.plan = plan
        self.include_reasoning = include_reasoning
        """False: the reasoning is split off and dropped (vLLM's include_reasoning)."""
        self.reasoning_cls = reasoning
        self.reasoning = reasoning() if reasoning is not None else None
        self.tool_parser = plan.parser(plan.tools) if plan.parser is not None else None
        self.held = ""  # forced mode: the JSON so far
        self.streamed: list[list] = []  # forced mode: per call, [id, argument characters sent]
        self.scanner = Scanner(plan.named is not None)  # forced mode: the calls in `held`
        self.called = False
        self.cut = False  # forced mode: the calls' JSON ended before it was whole (a stop string, a stop token)

    # -- whole

    def full(self, text: str) -> dict[str, Any]:
        plan = self.plan
        message: dict[str, Any] = {"content": text}
        if self.reasoning_cls is not None:
            reasoning, message["content"] = self.reasoning_cls.split(text)
            if self.include_reasoning:
                message["reasoning_content"] = reasoning
        if plan.mode == "forced":
            calls = forced_calls(message["content"] or "", plan.named, plan.call_id)
            self.cut = not _is_json(message["content"] or "")
            if calls:
                self.called = True
                message.update(content=None, tool_calls=[call.to_openai() for call in calls])
            return message
        if self.tool_parser is not None and message["content"]:
            parsed = type(self.tool_parser).parse(message["content"], plan.tools)
            calls = parsed.tool_calls if plan.parallel else parsed.tool_calls[:1]
            message["content"] = parsed.content
            if calls:
                self.called = True
                message["tool_calls"] = [call.to_openai() for call in calls]
        return message

    # -- streamed

    def feed(self, text: str) -> dict[str, Any]:
        return self._step(text, final=False)

    def finish(self) -> dict[str, Any]:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> dict[str, Any]:
        plan = self.plan
        delta: dict[str, Any] = {}
        content: str | None = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text) if text else (None, None)
            if final:
                more_reasoning, more_content = self.reasoning.finish()
                reasoning = (reasoning or "") + (more_reasoning or "") or None
                content = (content or "") + (more_content or "") or None
            if reasoning and self.include_reasoning:
                delta["reasoning_content"] = reasoning
        if plan.mode == "forced":
            return delta | self._forced_step(content or "", final)
        if self.tool_parser is None:
            if content:
                delta["content"] = content
            return delta
        out = self.tool_parser.feed(content) if content else []
        if final:
            out += self.tool_parser.finish()
        texts = "".join(piece for piece in out if isinstance(piece, str))
        deltas = [piece for piece in out if isinstance(piece, ToolCallDelta) and (plan.parallel or piece.index == 0)]
        if texts:
            delta["content"] = texts
        if deltas:
            self.called = True
            delta["tool_calls"] = _call_entries(deltas)
        return delta

    def _forced_step(self, text: str, final: bool) -> dict[str, Any]:
        """A call's head as soon as its name is generated, then its arguments as they grow."""
        self.held += text
        self.cut = final and not _is_json(self.held)
        deltas = []
        for index, call in enumerate(self.scanner.advance(self.held)):
            if call.name is None:
                break
            if index == len(self.streamed):
                self.streamed.append([self.plan.call_id(call.name, index), 0])
                deltas.append(ToolCallDelta(index, self.streamed[index][0], call.name, ""))
            sent = self.streamed[index][1]
            if len(call.arguments) > sent:
                deltas.append(ToolCallDelta(index, arguments=call.arguments[sent:]))
                self.streamed[index][1] = len(call.arguments)
        if deltas:
            self.called = True
            return {"tool_calls": _call_entries(deltas)}
        if final and not self.streamed and self.held:  # no call began (cut before a name): the text as it is
            return {"content": self.held}
        return {}

    def finish_reason(self, reason: str | None) -> str | None:
        """"tool_calls" for an output that ended on its own after calls; not for calls whose arguments a stop
        string cut off (their JSON is broken), which the client must not run as they are."""
        return "tool_calls" if self.called and not self.cut and reason == "stop" else reason


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def reasoning_parser_of(config: ServerConfig, prompt: str,
                        chat_template_kwargs: dict[str, Any] | None = None) -> type[ReasoningParser] | None:
    """The server's reasoning parser for a request; None when there is none, when the request's
    chat_template_kwargs turned thinking off (deepseek_v3), or when the prompt already closed the think block:
    the output is then all answer (deepseek_r1 would take it all for reasoning, as it has no </think>), and a
    constraint applies from the start. A prompt that opened the block gives the parser that starts inside it
    (ReasoningParser.after_prompt)."""
    if config.reasoning_parser is None:
        return None
    parser = get_reasoning_parser(config.reasoning_parser).for_request(chat_template_kwargs or {})
    if parser is None or parser.prompt_ends_reasoning(prompt):
        return None
    return parser.after_prompt(prompt)


def decode_options(plan: ToolPlan, reasoning: type[ReasoningParser] | None, tokenizer) -> dict[str, Any]:
    """How the output is decoded for the parsers, whose markers may be special tokens (GGUF conversions and some
    models make them so): skipped, the parsers would not see them, and reasoning, answer and calls would run
    together. Under "auto" the text keeps every special token ([TOOL_CALLS], <tool_call>, ...), as vLLM's tool
    parsers ask for; a reasoning parser keeps its markers (<think> and </think>, [THINK] and [/THINK]), the other
    special tokens skipped."""
    if plan.mode == "auto":
        return {"skip_special_tokens": False}
    if reasoning is None:
        return {}
    ids = []
    for marker in reasoning.starts + reasoning.ends:
        token_id = tokenizer.convert_tokens_to_ids(marker)
        if token_id is not None and tokenizer.convert_ids_to_tokens(token_id) == marker:  # one token, not unk
            ids.append(token_id)
    return {"keep_special_token_ids": ids}


def think_first(constraint: Constraint, reasoning: type[ReasoningParser] | None) -> Constraint:
    """The constraint applied only once the reasoning is over (after the parser's end marker as the chat template
    writes it: "</think>"), when there is a parser. A parser that takes an output opening no block for content
    (qwen3's, granite's) has the constraint apply from the first token of such an output (reasoning_start): else
    a model that answers without thinking (Granite without "thinking") was not constrained at all. A free structural
    tag's output may also end while thinking (none of its tags was due), as it may end without a tag."""
    if reasoning is None:
        return constraint
    end = reasoning.ends[0]
    start = None if reasoning.unopened_is_reasoning else reasoning.starts[0]
    if not constraint.free:
        return replace(constraint, params=replace(constraint.params, reasoning_end=end, reasoning_start=start))
    fmt = constraint.params.structural_tag["format"]
    thinking = {"type": "tag", "begin": start or "", "content": {"type": "any_text"}, "end": end}
    then = {"type": "sequence", "elements": [thinking, fmt]}
    unthought = fmt if start is not None else {"type": "any_text", "excludes": [end]}
    tag = {"type": "structural_tag", "format": {"type": "or", "elements": [unthought, then]}}
    return replace(constraint, params=replace(constraint.params, structural_tag=tag))
