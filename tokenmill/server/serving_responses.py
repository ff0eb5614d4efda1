"""POST /v1/responses: OpenAI's Responses API as an adapter over chat completions. The request becomes a chat
request (input items -> messages, flat function tools -> chat tools, text.format -> response_format,
reasoning.effort -> reasoning_effort), served by serving_chat's own path (template, tool plan and parsers,
reasoning parser, structured outputs, usage); its chat.completion (or its chunks) becomes a response object (or
the Responses event stream).

Nothing is stored: previous_response_id, conversation and background (which need responses kept by the server)
are refused with a 400 naming the field; the conversation goes in `input`, whole, each turn."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from tokenmill.engine.chat_template import object_arguments
from tokenmill.outputs import RequestOutput
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.openai_protocol import ChatCompletionRequest
from tokenmill.server.responses_protocol import CHAT_EXTRAS, ResponsesRequest
from tokenmill.server.serving_chat import ChatResponder, full_chat, start_chat
from tokenmill.server.state import ServerState
from tokenmill.server.streaming import SSEResponse, sse

STORED_ONLY = {"previous_response_id": "this server stores no responses",
               "conversation": "this server stores no conversations",
               "prompt": "this server stores no prompt templates"}
"""Fields that need what the server would have stored: a 400 unless null or absent."""
CHAT_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
               "reasoning_effort": "reasoning.effort", "truncate_prompt_tokens": "truncation"}
"""The chat request's fields -> the Responses fields they came from, which a 400 names."""


async def create_response(state: ServerState, req: ResponsesRequest, raw: Request):
    chat = to_chat_request(req)
    try:
        responder, stream, params = await start_chat(state, chat, raw, id_prefix="resp", cached_tokens=True)
    except APIError as e:  # named as the chat request's field: name the Responses field it came from
        if e.param == "max_completion_tokens":  # the context-length error names it in its text too
            e.message = e.message.replace(e.param, "max_output_tokens")
        if e.param in CHAT_PARAMS:  # "messages": the message at fault is named by its index in the chat messages
            e.param = CHAT_PARAMS[e.param]
        raise
    shell = ResponseShell(state, req, "resp_" + responder.request_id.removeprefix("resp-"),
                          params.temperature, params.top_p)
    if req.stream:
        return SSEResponse(ResponseEvents(shell).stream(responder, stream), headers={"Cache-Control": "no-cache"})
    body, status = await full_chat(raw, responder, stream, params)
    if status != 200:
        return JSONResponse(body, status_code=status)
    [choice] = body["choices"]
    message = choice["message"]
    items = []
    if reasoning := message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), reasoning))
    if content := message.get("content"):
        items.append(message_item(new_id("msg"), content))
    for call in message.get("tool_calls") or ():
        items.append(call_item(new_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"]))
    return JSONResponse(shell.body(choice["finish_reason"], items, body["usage"]))


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that serves a Responses request; a 400 for what it cannot serve."""
    _refuse(req)
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req), "stream": req.stream,
                            "parallel_tool_calls": req.parallel_tool_calls, "user": req.user,
                            "temperature": req.temperature, "top_p": req.top_p,
                            "max_completion_tokens": req.max_output_tokens}
    if req.stream:  # the last chunk has the usage, which response.completed carries
        body["stream_options"] = {"include_usage": True}
    if req.tools:
        body["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(req.tools)]
    if isinstance(choice := req.tool_choice, str):
        body["tool_choice"] = choice
    elif choice is not None:
        if choice.type != "function" or not choice.name:
            raise bad_request(f"tool_choice of type {choice.type!r} is not supported: pass \"none\", \"auto\", "
                              f"\"required\" or {{\"type\": \"function\", \"name\": ...}}", param="tool_choice")
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.name is None:
            raise bad_request("text.format.name is required with type json_schema", param="text.format.name")
        spec = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    if req.truncation == "auto":
        body["truncate_prompt_tokens"] = -1
    body.update(req.model_dump(include=set(CHAT_EXTRAS) & req.model_fields_set, by_alias=True))
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        error = e.errors()[0]
        loc = [str(part) for part in error["loc"]]
        field = CHAT_PARAMS.get(loc[0], loc[0]) if loc else None
        raise bad_request(f"{field}: {error['msg']}" if field else error["msg"], param=field) from e


def _refuse(req: ResponsesRequest) -> None:
    for name, why in STORED_ONLY.items():
        if getattr(req, name) not in (None, "", {}):
            raise bad_request(f"{name} is not supported: {why}; send the whole conversation in input (earlier "
                              f"turns' output items included)", param=name)
    if req.background:
        raise bad_request("background is not supported: this server stores no responses to fetch later; send the "
                          "request with background false", param="background")
    if req.max_tool_calls is not None:
        raise bad_request("max_tool_calls is not supported; use parallel_tool_calls false for one call at most",
                          param="max_tool_calls")
    if "message.output_text.logprobs" in (req.include or ()):
        raise bad_request("message.output_text.logprobs is not supported on /v1/responses: use "
                          "/v1/chat/completions with logprobs", param="include")


def _chat_tool(index: int, tool) -> dict:
    if tool.type != "function":
        raise bad_request(f"tools[{index}] has type {tool.type!r}: only function tools are supported (this server "
                          f"runs no built-in tools)", param="tools")
    if tool.name is None:
        raise bad_request(f"tools[{index}] needs a name", param="tools")
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters,
                "strict": tool.strict}
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _messages(req: ResponsesRequest) -> list[dict]:
    """The chat messages of the instructions and the input. A function_call item joins the assistant message just
    before it (as the calls of one chat turn), else opens one; reasoning items are dropped, as by vLLM."""
    messages: list[dict] = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    for index, item in enumerate(req.input):
        if item.type == "message":
            content = item.content if isinstance(item.content, str) else [
                {"type": "text", "text": part.text if part.type != "refusal" else part.refusal}
                for part in item.content]
            messages.append({"role": item.role, "content": content})
        elif item.type == "function_call":
            _check_arguments(item.arguments, f"input[{index}].arguments")
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "function_call_output":
            output = item.output if isinstance(item.output, str) else "\n".join(part.text for part in item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    return messages


def _check_arguments(arguments: str, where: str) -> None:
    """A 400 naming the input item for a call's arguments that are not a JSON object (the chat messages they become
    would say `messages[i].tool_calls[j]`, which the request never had)."""
    if object_arguments(arguments) is None:
        raise bad_request(f"{where} must be a JSON object (a function call's arguments), got {arguments[:80]!r}",
                          param=where)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def outcome(finish_reason: str | None) -> tuple[str, dict | None]:
    """A response's status and incomplete_details from its chat finish_reason."""
    if finish_reason in ("stop", "tool_calls"):
        return "completed", None
    return "incomplete", {"reason": "max_output_tokens" if finish_reason == "length" else None}


class ResponseShell:
    """A response object but its output, status and usage: the request's settings echoed, as OpenAI does."""

    def __init__(self, state: ServerState, req: ResponsesRequest, response_id: str, temperature: float,
                 top_p: float) -> None:
        self.id, self.created_at = response_id, int(time.time())
        tools = [tool.model_dump() for tool in req.tools or ()]
        choice = req.tool_choice
        text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text is not None else {}
        self.settings = {
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
            "metadata": req.metadata or {}, "model": state.model_name, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": None, "background": False, "store": False,
            "reasoning": None if req.reasoning is None else req.reasoning.model_dump(exclude_none=True),
            "service_tier": req.service_tier or "auto", "temperature": temperature, "top_p": top_p,
            "text": {"format": {"type": "text"}, **text},
            "tool_choice": (choice if isinstance(choice, str) else {"type": "function", "name": choice.name})
            if choice is not None else ("auto" if tools else "none"),
            "tools": tools, "top_logprobs": 0, "truncation": req.truncation, "user": req.user,
        }

    def body(self, finish_reason: str | None, output: list[dict], chat_usage: dict | None) -> dict:
        """The whole response; `finish_reason`: the chat choice's (None: still in progress)."""
        status, incomplete = ("in_progress", None) if finish_reason is None else outcome(finish_reason)
        if status == "incomplete" and output:
            output[-1]["status"] = "incomplete"
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": None,
                "incomplete_details": incomplete, **self.settings, "output": output,
                "usage": None if chat_usage is None else responses_usage(chat_usage)}


def responses_usage(usage: dict) -> dict:
    """A chat usage object in Responses' shape."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": usage["total_tokens"]}


class ResponseEvents:
    """A chat request's chunks as the Responses event stream: each output item added, its text or arguments in
    deltas, done before the next is added; response.completed (or .incomplete) with the whole response last."""

    def __init__(self, shell: ResponseShell) -> None:
        self.shell = shell
        self.sequence_number = 0
        self.items: list[dict] = []
        """The output so far; the last one may be open (status in_progress)."""

    def _event(self, type_: str, **fields) -> str:
        event = {"type": type_, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {type_}\n{sse(event)}"

    async def stream(self, responder: ChatResponder, stream: AsyncGenerator[RequestOutput, None]) -> AsyncIterator[str]:
        shell = self.shell
        yield self._event("response.created", response=shell.body(None, [], None))
        yield self._event("response.in_progress", response=shell.body(None, [], None))
        finish_reason, usage = None, None
        async with aclosing(responder.chunks(stream)) as chunks:  # closed, it aborts the request
            async for chunk in chunks:
                if "error" in chunk:
                    error = chunk["error"]
                    yield self._event("error", code=error["code"], message=error["message"], param=error["param"])
                    return
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    delta = choice["delta"]
                    for event in self._delta(delta):
                        yield event
                    finish_reason = choice["finish_reason"] or finish_reason
        status, _ = outcome(finish_reason)
        for event in self._close(status):
            yield event
        body = shell.body(finish_reason, [dict(item) for item in self.items], usage)
        yield self._event(f"response.{body['status']}", response=body)

    def _delta(self, delta: dict) -> list[str]:
        events = []
        if reasoning := delta.get("reasoning_content"):
            events += self._text("reasoning", reasoning)
        if content := delta.get("content"):
            events += self._text("message", content)
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        return events

    def _open(self) -> dict | None:
        return self.items[-1] if self.items and self.items[-1]["status"] == "in_progress" else None

    def _add(self, item: dict) -> list[str]:
        events = self._close("completed")
        self.items.append(item)
        return [*events, self._event("response.output_item.added", output_index=len(self.items) - 1, item=item)]

    def _text(self, kind: str, text: str) -> list[str]:
        """A reasoning or message item's text; the item (and its one content part) added first if not open."""
        events = []
        item = self._open()
        if item is None or item["type"] != kind:
            item_id = new_id("rs" if kind == "reasoning" else "msg")
            empty = reasoning_item(item_id, "", "in_progress") if kind == "reasoning" else \
                message_item(item_id, None, "in_progress")
            events += self._add({**empty, "content": []})
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else \
                {"type": "output_text", "text": "", "annotations": []}
            events.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
            item = self.items[-1]
            item["content"] = [dict(part)]
        item["content"][0]["text"] += text
        if kind == "reasoning":
            events.append(self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text))
        else:
            events.append(self._event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                      logprobs=[]))
        return events

    def _call(self, entry: dict) -> list[str]:
        events = []
        function = entry.get("function") or {}
        if entry.get("id") is not None:  # a call's head
            events += self._add(call_item(new_id("fc"), entry["id"], function["name"], "", "in_progress"))
        item = self._open()
        if arguments := function.get("arguments"):
            assert item is not None and item["type"] == "function_call", "a call's arguments come after its head"
            item["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return events

    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _close(self, status: str) -> list[str]:
        """The open item's done events, with its final `status`."""
        item = self._open()
        if item is None:
            return []
        item["status"] = status
        where = self._where()
        if item["type"] == "function_call":
            events = [self._event("response.function_call_arguments.done", **where, arguments=item["arguments"])]
        else:
            part = item["content"][0]
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            text_done = {"text": part["text"]} if kind == "reasoning_text" else {"text": part["text"], "logprobs": []}
            events = [self._event(f"response.{kind}.done", **where, content_index=0, **text_done),
                      self._event("response.content_part.done", **where, content_index=0, part=dict(part))]
        events.append(self._event("response.output_item.done", output_index=where["output_index"],
                                  item=json.loads(json.dumps(item))))
        return events
