"""Pydantic model of a POST /v1/responses body: OpenAI's Responses fields (the openai SDK's
`types/responses` name them) plus the vLLM sampling extras a chat completion takes, whose definitions (bounds,
docs) are chat's own. The request is served as a chat completion (serving_responses.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, create_model

from tokenmill.server.openai_protocol import ChatCompletionRequest, RequestBody, RequestModel, TokenCount


class InputText(RequestModel):
    """A text part of a message: input_text (user, system, developer) or output_text (an assistant message
    replayed); its other fields (annotations, logprobs) are ignored."""

    model_config = ConfigDict(extra="allow")

    type: Literal["input_text", "output_text"]
    text: str


class Refusal(RequestModel):
    """A refusal part of an assistant message replayed: its text goes to the template as content."""

    type: Literal["refusal"]
    refusal: str


def _part_type(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "text" if kind in ("input_text", "output_text") else kind


ContentPart = Annotated[
    Annotated[InputText, Tag("text")] | Annotated[Refusal, Tag("refusal")],
    Discriminator(_part_type, custom_error_type="content_part_type",
                  custom_error_message="a content part's type must be input_text, output_text or refusal (this "
                                       "server serves text: no images, files or audio)"),
]


class MessageItem(RequestModel):
    """A message; `id` and `status` (of an output message replayed) are ignored."""

    model_config = ConfigDict(extra="allow")

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[Annotated[str, Tag("text")] | Annotated[list[ContentPart], Tag("parts")],
                       Discriminator(lambda value: "text" if isinstance(value, str) else "parts")]


class FunctionCallItem(RequestModel):
    """A call the model made, replayed: the assistant message's tool call `call_id`."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str
    """A JSON object, as text."""


class FunctionCallOutputItem(RequestModel):
    """A call's result: the tool message answering `call_id`."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[InputText]
    """Text, or text parts (joined with newlines)."""


class ReasoningItem(RequestModel):
    """A reasoning item replayed: ignored, as by vLLM (chat templates drop past turns' reasoning)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["reasoning"]


def _item_type(value: Any) -> str | None:
    """An item's type; a message may leave it out (OpenAI's EasyInputMessage)."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type, custom_error_type="input_item_type",
                  custom_error_message="an input item's type must be message, function_call, function_call_output "
                                       "or reasoning (other items need tools or stored responses this server does "
                                       "not have)"),
]


class ResponsesTool(RequestModel):
    """A tool, in Responses' flat form. Only type "function" is served: any other type (web_search, file_search,
    mcp, ...) is a 400 naming it."""

    model_config = ConfigDict(extra="allow")

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    """As in chat: true enforces the arguments' schema once a call starts under "auto"; absent or null: not
    strict."""


class ToolChoiceObject(RequestModel):
    """{"type": "function", "name": ...}: a call to that function. Other types (hosted tools, allowed_tools, mcp,
    custom) are a 400 naming them."""

    model_config = ConfigDict(extra="allow")

    type: str
    name: str | None = None


class TextFormat(RequestModel):
    """text.format: {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema", "name", "schema",
    "strict"} (chat's response_format of the same type)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    """Required with json_schema, as by OpenAI."""
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    """Accepted: the schema is always enforced."""


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    """Accepted and ignored: no chat template here reads it."""


class ReasoningConfig(RequestModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    """Chat's reasoning_effort: the chat template's variable, which turns thinking on unless "none"."""
    summary: Literal["auto", "concise", "detailed"] | None = None
    """Accepted and ignored: the reasoning comes whole (reasoning_text), never summarized."""
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    """OpenAI's deprecated name of summary: likewise ignored."""


CHAT_EXTRAS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
               "logit_bias", "ignore_eos", "min_tokens", "stop_token_ids", "bad_words", "allowed_token_ids",
               "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "priority",
               "cache_salt", "request_id", "thinking_token_budget", "include_reasoning", "chat_template",
               "chat_template_kwargs", "structured_outputs")
"""The chat request's fields (vLLM's extras) a Responses request takes too, passed on as they are."""


class ResponsesFields(RequestBody):
    """OpenAI's fields of a Responses request."""

    model: str | None = None
    input: Annotated[Annotated[str, Tag("text")] | Annotated[list[InputItem], Field(min_length=1), Tag("items")],
                     Discriminator(lambda value: "text" if isinstance(value, str) else "items")]
    """Text (one user message), or items: messages, function calls and their outputs, reasoning (ignored)."""
    instructions: str | None = None
    """A system message before the input."""
    tools: list[ResponsesTool] | None = None
    tool_choice: Annotated[Annotated[Literal["none", "auto", "required"], Tag("mode")]
                           | Annotated[ToolChoiceObject, Tag("object")],
                           Discriminator(lambda value: "mode" if isinstance(value, str) else "object")] | None = None
    """As in chat: absent, "auto" with tools and "none" without; "auto" needs --enable-auto-tool-choice and
    --tool-call-parser, "required" and a named function are enforced with structured outputs."""
    parallel_tool_calls: bool = True
    max_output_tokens: TokenCount | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: Annotated[int, Field(ge=0, le=0)] | None = None
    """Logprobs are not served on /v1/responses yet: 0 or absent."""
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    """Echoed in the response."""
    user: str | None = None
    store: bool = True
    """Accepted; nothing is stored (the response says store false): send the whole conversation in input."""
    include: list[str] | None = None
    """Accepted: reasoning.encrypted_content asks for nothing more (reasoning comes as text); the others name
    outputs of tools this server does not run. message.output_text.logprobs is refused."""
    truncation: Literal["auto", "disabled"] = "disabled"
    """"auto": the rendered conversation's first tokens are dropped to fit the context (chat's
    truncate_prompt_tokens -1)."""
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    """Accepted and echoed; every request is served alike."""
    stream_options: dict[str, Any] | None = None
    """Accepted and ignored (include_obfuscation: no obfuscation is sent)."""
    prompt_cache_key: str | None = None
    """Accepted and ignored: a routing hint; the prefix cache needs none."""
    safety_identifier: str | None = None
    # Refused with a 400 unless null or absent: they need responses stored by the server.
    previous_response_id: str | None = None
    """Not supported: this server stores no responses; send the conversation in input."""
    conversation: str | dict[str, Any] | None = None
    """Not supported: likewise."""
    background: bool | None = None
    """Not supported: true is refused (a background response is fetched later, from a store)."""
    prompt: dict[str, Any] | None = None
    """Not supported (OpenAI's stored prompt templates)."""
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    """Not supported: a 400 unless null or absent."""


ResponsesRequest = create_model(
    "ResponsesRequest", __base__=ResponsesFields, __doc__="A POST /v1/responses body.",
    **{name: (ChatCompletionRequest.model_fields[name].annotation, ChatCompletionRequest.model_fields[name])
       for name in CHAT_EXTRAS},
)
