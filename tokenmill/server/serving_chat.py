"""POST /v1/chat/completions: messages -> the model's chat template -> chat.completion, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from tokenmill.engine.async_engine import EngineDeadError
from tokenmill.engine.chat_template import normalize_messages, render_chat_text, resolve_content_format
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.beam_search import beam_search_params, run_beam_search
from tokenmill.server.choices import collect
from tokenmill.server.config import TEMPLATE_ARGUMENTS
from tokenmill.server.errors import bad_request, choice_failed, error_body
from tokenmill.server.logprobs import chat_logprobs, vllm_prompt_logprobs
from tokenmill.server.openai_protocol import ChatCompletionRequest, TokenizeRequest
from tokenmill.server.sampling import (
    check_combinations,
    refuse_unsupported,
    resolve_max_tokens,
    stream_usage,
    to_sampling_params,
    truncate_prompt,
)
from tokenmill.server.state import LONG_TEXT_CHARS, ServerState, make_request_ids
from tokenmill.server.streaming import DONE, SSEResponse, cancel_on_disconnect, sse
from tokenmill.server.structured_outputs import constraint_of
from tokenmill.server.tools import ChoiceText, ToolPlan, decode_options, plan_tools, reasoning_parser_of, think_first
from tokenmill.server.usage import chat_usage


def template_variables(state: ServerState, req: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
    """The chat template's variables of a request, as the template and the reasoning parser both see them: the
    server's --default-chat-template-kwargs under the request's chat_template_kwargs (as vLLM's), and vLLM's request
    fields that are template variables (documents, reasoning_effort) over both."""
    variables = {**state.config.default_chat_template_kwargs, **(req.chat_template_kwargs or {})}
    for name in ("documents", "reasoning_effort"):
        if (value := getattr(req, name, None)) is not None:
            variables[name] = value
    if (effort := getattr(req, "reasoning_effort", None)) is not None:  # as vLLM's: templates that need thinking on
        variables.setdefault("enable_thinking", effort != "none")
    return variables


async def render_messages(state: ServerState, req: ChatCompletionRequest | TokenizeRequest) -> tuple[str, list[int]]:
    """The prompt of a chat request (also used by /tokenize); 400 for anything the template rejects."""
    if state.engine.tokenizer is None:
        raise bad_request("this server was started without a tokenizer: chat is unavailable")
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true; "
                          "set add_generation_prompt to false", param="continue_final_message")
    chat_template = req.chat_template
    # A template is code the server runs. render_chat renders through tokenizer.apply_chat_template,
    # i.e. in transformers' sandboxed Jinja environment, but even sandboxed a template can run for long.
    if chat_template is not None and not state.config.trust_request_chat_template:
        raise bad_request("chat templates sent in requests are refused unless the server is started with "
                          "--trust-request-chat-template", param="chat_template")
    template_kwargs = template_variables(state, req)
    if taken := sorted(TEMPLATE_ARGUMENTS & template_kwargs.keys()):
        raise bad_request(f"chat_template_kwargs may not set {', '.join(taken)}: the server passes these itself "
                          "(send add_generation_prompt, continue_final_message and chat_template as request fields)",
                          param="chat_template_kwargs")
    if req.tools:
        if "tools" in template_kwargs:
            raise bad_request("pass tools in tools, not in chat_template_kwargs", param="chat_template_kwargs")
        template_kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in req.tools]
    try:
        conversation = [message.model_dump(exclude_none=True) for message in req.messages]
        content_format = resolve_content_format(state.config.chat_template_content_format, state.engine.tokenizer,
                                                chat_template, template_kwargs.get("tools"))
        add_special_tokens = bool(req.add_special_tokens)  # /tokenize's None: false for messages, as vLLM's
        text, token_ids = await state.tokenize(
            _render,
            normalize_messages(conversation, content_format),
            add_special_tokens,
            text_chars=sum(len(str(message.get("content") or "")) for message in conversation),
            chat_template=chat_template,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            **template_kwargs,
        )
        if token_ids is None:
            token_ids = await state.tokenize(_encode, text, add_special_tokens, text_chars=len(text))
        return text, token_ids
    except (ValueError, TypeError) as e:
        raise bad_request(str(e), param="messages") from e
    except Exception as e:  # what a template's own code raises (1 // 0, ...) is this request's fault
        raise bad_request(f"the chat template failed: {type(e).__name__}: {e}", param="messages") from e


def _render(tokenizer, conversation: list[dict[str, Any]], add_special_tokens: bool,
            **kwargs: Any) -> tuple[str, list[int] | None]:
    """The prompt's text, and its token ids unless the text is long: a template may write far more than the messages
    hold (the tools, documents, a loop of its own), and those are tokenized on the long texts' thread instead, where
    they hold up no other request's tokenization (before, ~1 s a million characters for every request behind)."""
    text = render_chat_text(tokenizer, conversation, **kwargs)
    return text, None if len(text) >= LONG_TEXT_CHARS else _encode(tokenizer, text, add_special_tokens)


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    # The rendered text already holds the special tokens (BOS) the template wants: by default none are added.
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _check_unsupported(req: ChatCompletionRequest) -> None:
    # Ignored, a client of the legacy form would get no call where it asked for one (and none in the legacy form).
    for legacy, current in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(req, legacy) is not None:
            raise bad_request(f"{legacy} (OpenAI's deprecated form of {current}) is not supported: pass the functions "
                              f"in tools and the choice in tool_choice", param=legacy)
    if req.top_logprobs not in (None, 0) and not req.logprobs:  # 0 asks for none: served, as vLLM does
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request):
    responder, stream, params = await start_chat(state, req, raw)
    if req.stream:
        return SSEResponse(responder.stream(stream))
    body, status = await full_chat(raw, responder, stream, params)
    return JSONResponse(body, status_code=status)


async def full_chat(raw: Request, responder: ChatResponder, stream: AsyncGenerator[RequestOutput, None],
                    params: SamplingParams) -> tuple[dict, int]:
    """A started request's whole chat.completion (200), or its error (400: a choice failed, errors.choice_failed)."""
    last, choices = await cancel_on_disconnect(raw, collect(stream, params))
    if (error := choice_failed(choices)) is not None:
        return error, 400
    return responder.full(last, choices), 200


async def start_chat(state: ServerState, req: ChatCompletionRequest, raw: Request, id_prefix: str = "chatcmpl",
                     cached_tokens: bool | None = None,
                     ) -> tuple[ChatResponder, AsyncGenerator[RequestOutput, None], SamplingParams]:
    """A chat request checked, rendered and added to the engine: its responder, its output stream and its sampling
    params (/v1/responses serves its requests through this too). `id_prefix`: of the response's id;
    `cached_tokens`: the usage reports the prompt's cached tokens (None: as --enable-prompt-tokens-details)."""
    state.check_model(req.model)
    check_combinations(req)
    refuse_unsupported(req)
    _check_unsupported(req)
    constraint = constraint_of(req)
    plan = plan_tools(req, state.config, constrained=constraint is not None)
    if plan.constraint is not None:
        constraint = plan.constraint
    if constraint is not None and req.use_beam_search:
        raise bad_request("structured outputs (and tool_choice \"required\", a named function or strict tools) are "
                          "not supported with use_beam_search", param=constraint.param)
    if constraint is not None:
        await state.grammar_checker.check(constraint, state.engine.input_processor)
    text, token_ids = await render_messages(state, req)
    reasoning = reasoning_parser_of(state.config, text, template_variables(state, req))
    if constraint is not None:  # the model may think first: the constraint (strict tools' too) starts after it
        constraint = think_first(constraint, reasoning)
    engine = state.engine
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    kept = truncate_prompt(token_ids, req.truncate_prompt_tokens, requested, engine.max_model_len)
    if len(kept) < len(token_ids):
        text, token_ids = None, kept
    max_tokens = resolve_max_tokens(requested, len(token_ids), engine.max_model_len, param, "messages")
    params = to_sampling_params(req, max_tokens, logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                prompt_logprobs=req.prompt_logprobs,
                                structured_outputs=None if constraint is None else constraint.params,
                                **decode_options(plan, reasoning, engine.tokenizer),
                                defaults=state.sampling_defaults, max_logprobs=engine.input_processor.max_logprobs,
                                vocab_size=engine.input_processor.vocab_size)
    search = beam_search_params(req, max_tokens) if req.use_beam_search else None
    vocab_bytes = await state.vocab_bytes() if req.logprobs else None  # before the request is added: nothing to undo
    state.check_capacity(params.num_samples)
    request_id, engine_request_id = make_request_ids(id_prefix, raw.headers, req.request_id)
    prompt = {"prompt": text, "prompt_token_ids": token_ids}
    if search is not None:
        stream = run_beam_search(state, engine_request_id, prompt, search, params, req.priority, req.cache_salt)
    else:
        [stream] = state.add_requests(engine_request_id, [prompt], [params], req.priority, req.cache_salt)
    responder = ChatResponder(state, req, request_id, token_ids, plan, reasoning, vocab_bytes, cached_tokens)
    return responder, stream, params


class ChatResponder:
    def __init__(self, state: ServerState, req: ChatCompletionRequest, request_id: str, prompt_token_ids: list[int],
                 plan: ToolPlan | None = None, reasoning=None, vocab_bytes: list[bytes] | None = None,
                 cached_tokens: bool | None = None) -> None:
        self.req, self.request_id = req, request_id
        self.prompt_token_ids = prompt_token_ids
        self.plan = plan if plan is not None else ToolPlan(None)
        self.reasoning = reasoning
        self.plain = self.plan.mode == "none" and reasoning is None
        """No tools to parse and no reasoning to split: the text goes out as it came."""
        self.model_name = state.model_name
        self.name = state.token_namer(req)
        self.decode = state.decode_token
        # The role of the message the model writes: the one the generation prompt starts (the server's
        # --response-role), else that of the last message, which the model continues.
        self.role = state.config.response_role if req.add_generation_prompt else req.messages[-1].role
        last = req.messages[-1]
        self.echo = _content_text(last.content) if req.echo and last.role == self.role else ""
        """vLLM's chat echo: the last message's content, which the answer's content starts with."""
        self.vocab_bytes = vocab_bytes
        self.created = int(time.time())
        self.stream_usage = stream_usage(req, state.config.enable_force_include_usage)
        """A stream's usage: in a last chunk, and in every chunk."""
        self.usage = chat_usage(state, prompt_token_ids, reasoning, cached_tokens,
                                reported=not req.stream or self.stream_usage[0])

    def _logprobs(self, token_ids: list[int], entries) -> dict | None:
        if not self.req.logprobs or entries is None:
            return None
        return chat_logprobs(token_ids, entries, self.req.top_logprobs or 0, self.name, self.vocab_bytes)

    def full(self, last: RequestOutput, choices: list) -> dict:
        body, usage = [], self.usage
        usage.saw(last)
        for index, choice in enumerate(choices):
            text = ChoiceText(self.plan, self.reasoning, self.req.include_reasoning)
            message = {"content": choice.text} if self.plain else text.full(choice.text)
            if self.echo:
                message["content"] = self.echo + (message["content"] or "")
            body.append({
                "index": index,
                "message": {"role": self.role, **message},
                "logprobs": self._logprobs(choice.token_ids, choice.logprobs),
                "finish_reason": text.finish_reason(choice.finish_reason),
                "stop_reason": choice.stop_reason,
                **self._token_ids(choice.token_ids),
            })
            usage.add(choice.token_ids, index)
        return {"id": self.request_id, "object": "chat.completion", "created": self.created,
                "model": self.model_name, "choices": body, "usage": usage.body(),
                **self._prompt_token_ids(), **self._prompt_logprobs(last.prompt_logprobs)}

    def _prompt_logprobs(self, entries: list | None) -> dict:
        if self.req.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": vllm_prompt_logprobs(self.prompt_token_ids, entries or [], self.req.prompt_logprobs,
                                                        self.decode)}

    def _token_ids(self, token_ids: list[int]) -> dict:
        """A choice's (or a chunk's) return_token_ids field."""
        return {"token_ids": list(token_ids)} if self.req.return_token_ids else {}

    def _prompt_token_ids(self) -> dict:
        """The answer's (or its first chunk's) return_token_ids field."""
        return {"prompt_token_ids": self.prompt_token_ids} if self.req.return_token_ids else {}

    def _chunk(self, choices: list[dict], **extra) -> dict:
        return {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model_name, "choices": choices, **extra}

    async def stream(self, stream: AsyncGenerator[RequestOutput, None]) -> AsyncIterator[str]:
        """The chat.completion.chunk events, then [DONE]."""
        async with aclosing(self.chunks(stream)) as chunks:
            async for chunk in chunks:
                yield sse(chunk)
        yield DONE

    async def chunks(self, stream: AsyncGenerator[RequestOutput, None]) -> AsyncIterator[dict]:
        """The chunks of a stream, as dicts; an error (OpenAI's {"error": ...}) is the last."""
        req, usage = self.req, self.usage
        final_usage, every_chunk_usage = self.stream_usage

        def chunk(choices: list[dict], **extra) -> dict:
            if every_chunk_usage:
                extra["usage"] = usage.body()
            return self._chunk(choices, **extra)

        texts: dict[int, ChoiceText] = {}
        endings = []
        held = {} if self.plan.mode == "forced" else {"content": ""}  # a step whose text is all held back
        try:
            for index in range(req.n):  # the prompt's ids (return_token_ids) in the first chunk alone
                yield chunk([{"index": index, "delta": {"role": self.role, "content": ""}, "logprobs": None,
                              "finish_reason": None}], **(self._prompt_token_ids() if index == 0 else {}))
            for index in range(req.n if self.echo else 0):  # as vLLM's: after every choice's role chunk
                yield chunk([{"index": index, "delta": {"content": self.echo}, "logprobs": None,
                              "finish_reason": None}])
            async with aclosing(stream):  # so that a client leaving aborts the request now, not once collected
                async for output in stream:
                    usage.saw(output)
                    for completion in output.outputs:
                        usage.add(completion.token_ids, completion.index)
                        logprobs = self._logprobs(completion.token_ids, completion.logprobs)
                        if (text := texts.get(completion.index)) is None:
                            text = texts[completion.index] = ChoiceText(self.plan, self.reasoning,
                                                                        req.include_reasoning)
                        if self.plain:
                            delta = {"content": completion.text}
                        else:
                            delta = text.feed(completion.text)
                            if completion.finish_reason is not None:
                                for key, value in text.finish().items():
                                    delta[key] = delta[key] + value if key in delta else value
                        # A chunk per step with new tokens, even when their text is held back: clients
                        # count chunks as tokens arriving.
                        visible = bool(completion.text) if self.plain else bool(delta)
                        if visible or completion.token_ids or logprobs is not None:
                            yield chunk([{"index": completion.index, "delta": delta or held,
                                          "logprobs": logprobs, "finish_reason": None,
                                          **self._token_ids(completion.token_ids)}])
                        if completion.finish_reason is not None:
                            endings.append(completion)
                            yield chunk([{"index": completion.index, "delta": {}, "logprobs": None,
                                          "finish_reason": text.finish_reason(completion.finish_reason),
                                          "stop_reason": completion.stop_reason}])
            if final_usage:
                yield self._chunk([], usage=usage.body())
            if (error := choice_failed(endings)) is not None:
                yield error
        except EngineDeadError as e:
            yield error_body(503, f"the engine is not running: {e}", code="engine_dead")


def _content_text(content) -> str:
    """A message's content as text: its text parts joined with newlines, as the chat template sees them."""
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(part.text for part in content)
