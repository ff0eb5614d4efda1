"""Pydantic models of the request bodies: OpenAI's fields plus vLLM's sampling extras.

Every bound the server enforces on one field is declared here (ranges, enums, lengths), so that it is
refused with a 400 before anything reaches the engine and /openapi.json publishes it. The bounds of
the numeric sampling fields mirror SamplingParams.validate(); checks across fields (min_tokens <=
max_tokens, best_of >= n, the context length, the vocabulary) stay in sampling.py and the engine.

Unknown fields are ignored, as OpenAI clients send fields a server may not know, and logged once per request
with a warning naming them (a misspelt vLLM extra does nothing, and the log says so). Responses are
plain dicts built in the serving modules, in OpenAI's wire format.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    ModelWrapValidatorHandler,
    Tag,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tokenmill.server.limits import (
    INT64_MAX,
    INT64_MIN,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_PROMPTS,
    MAX_SEQUENCES,
    MAX_STOP_STRINGS,
    MAX_TOKEN_COUNT,
    TOKEN_ID_END,
)
from tokenmill.server.unicode_text import find_lone_surrogate

logger = logging.getLogger(__name__)


def _integral_float_to_int(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


INTEGRAL = BeforeValidator(_integral_float_to_int)
"""JSON Schema counts 3.0 as an integer; strict validation alone would not (it refuses true and "3",
as the schema does). After the bounds in an Annotated, so that the schema still shows them."""
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX), INTEGRAL]
TokenId = Annotated[int, Field(ge=0, lt=TOKEN_ID_END), INTEGRAL]
TokenCount = Annotated[int, Field(ge=1, le=MAX_TOKEN_COUNT), INTEGRAL]
SampleCount = Annotated[int, Field(ge=1, le=MAX_N), INTEGRAL]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL]
NumLogprobsOrAll = Annotated[int, Field(ge=-1, le=MAX_LOGPROBS), INTEGRAL]
"""-1: every token of the vocabulary (vLLM's, for prompt_logprobs and chat's top_logprobs; not completions'
logprobs), allowed where the server's --max-logprobs is -1."""
NonEmptyStr = Annotated[str, Field(min_length=1)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
LogitBias = Annotated[
    # JSON keys are strings, read as numbers; the key's integer schema alone would not be published.
    dict[Annotated[int, Field(strict=False, ge=0, lt=TOKEN_ID_END)],
         Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
    Field(json_schema_extra={"propertyNames": {"pattern": "^[0-9]{1,10}$"}}),
]


class RequestModel(BaseModel):
    # Strict: what passes is what the schema says (no true for 1, no "3" for 3). Python's json module
    # reads NaN and Infinity, which no parameter means anything with.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, use_attribute_docstrings=True)


class RequestBody(RequestModel):
    """A whole request body: its strings, at any depth, must be valid Unicode (see unicode_text.py)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if isinstance(data, dict) and (found := find_lone_surrogate(data)) is not None:
            path, surrogate = found
            raise PydanticCustomError(
                "string_unicode", "{param}: a string holds a lone surrogate ({surrogate}), which is not valid "
                "Unicode", {"param": path, "surrogate": surrogate})
        return data

    @model_validator(mode="wrap")
    @classmethod
    def _warn_of_ignored_fields(cls, data: Any, handler: ModelWrapValidatorHandler) -> Any:
        body = handler(data)
        if isinstance(data, dict) and (ignored := data.keys() - _known_fields(cls)):
            logger.warning("the request's fields %s are not known and were ignored", ", ".join(sorted(ignored)))
        return body


def _known_fields(cls: type[BaseModel]) -> set[str]:
    """The names a body may use: each field's name and its alias (json for json_)."""
    return {name for key, info in cls.model_fields.items() for name in (key, info.alias) if name is not None}


class StreamOptions(RequestModel):
    include_usage: bool = False
    """A last chunk, with no choices, carries the usage of the whole request."""
    continuous_usage_stats: bool = False
    """With include_usage, every chunk carries the usage so far as well (vLLM's)."""


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionCall(RequestModel):
    name: NonEmptyStr
    arguments: str
    """A JSON object, as text (as OpenAI sends it); the chat template sees it parsed."""


class MessageToolCall(RequestModel):
    """One of an assistant message's tool_calls, as OpenAI returned it."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    # Other fields are kept and reach the chat template as sent.
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    """Text, or a list of text parts (joined with newlines); no images or audio."""
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    """An assistant message's calls (its content may then be null)."""
    tool_call_id: str | None = None
    """Required in a tool message: the id of the call it answers."""

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages may have tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id")
        return self


class FunctionDefinition(RequestModel):
    model_config = ConfigDict(extra="allow")

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The JSON schema of the arguments; absent: an object with no parameters."""
    strict: bool | None = None
    """With tool_choice "auto", true enforces the parameters' schema once the model starts a call to this
    function (a structural tag in the tool parser's format); with "required" or a named function the schema is
    always enforced."""

    @model_validator(mode="after")
    def _object_parameters(self) -> FunctionDefinition:
        # Arguments are a JSON object (as OpenAI requires of the schema): a forced call under {"type": "array"}
        # would come back with arguments the next turn's messages refuse, and the tool parsers never read one.
        kind = (self.parameters or {}).get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            raise ValueError(f"parameters must be a JSON schema of type \"object\" (a call's arguments are a JSON "
                             f"object), not of type {json.dumps(kind)}")
        return self


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: NonEmptyStr


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


Messages = Annotated[list[ChatMessage], Field(min_length=1)]


def _prompt_form(value: Any) -> str:
    """Which form a prompt takes, so that a malformed one gets the errors of that form alone."""
    if isinstance(value, str):
        return "text"
    first = value[0] if isinstance(value, list) and value else None
    if isinstance(first, list):
        return "token_id_lists"
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return "token_ids"
    return "texts"


class JsonSchemaSpec(RequestModel):
    """OpenAI's response_format.json_schema."""

    name: str
    """Required, as by OpenAI; it names the schema and does not change the output."""
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    """The JSON schema the output validates against; absent or null: any JSON value."""
    strict: bool | None = None
    """Accepted and ignored: the schema is always enforced (as with OpenAI's strict=true)."""


class ResponseFormat(RequestModel):
    """OpenAI's response_format. One model rather than a union tagged by type, so that an error names
    the field as sent (response_format.json_schema.name, not a path through the union's tag)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaSpec | None = None
    """Required with type json_schema, ignored otherwise."""
    format: dict[str, Any] | None = None
    """type structural_tag (vLLM's): xgrammar's structural tag format object; or, the legacy form, structures
    and triggers (as in structured_outputs.structural_tag)."""
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is json_schema")
        if self.type == "structural_tag" and self.format is None and (self.structures is None or
                                                                      self.triggers is None):
            raise ValueError("type structural_tag needs format, or structures and triggers")
        return self


class StructuredOutputsRequest(RequestModel):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, structural_tag and json_object.

    Options of vLLM's that only pick how the constraint is enforced are accepted and ignored, as by vLLM
    (disable_fallback, disable_any_whitespace, disable_additional_properties: the server's
    --structured-outputs-config decides them); so is the older top-level guided_decoding_backend. Any other key
    here (whitespace_pattern, ...) and the older
    guided_whitespace_pattern are refused with a 400 naming them rather than ignored: the client would
    expect a shape of output that does not hold."""

    model_config = ConfigDict(extra="allow")

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    """A JSON schema, as an object or its JSON text."""
    regex: str | None = None
    choice: list[str] | None = None
    """The output is exactly one of these (non-empty) strings."""
    grammar: str | None = None
    """An EBNF grammar (GBNF-style, with a `root` rule)."""
    json_object: bool = False
    """Any JSON object."""
    structural_tag: str | dict[str, Any] | None = None
    """Free text with structured parts: {"structures": [{"begin", "schema", "end"}], "triggers": [...]} (the
    legacy form) or {"type": "structural_tag", "format": {...}} (xgrammar's format object), or its JSON text."""
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False


Prompt = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS), Tag("texts")]
    | Annotated[list[TokenId], Field(min_length=1), Tag("token_ids")]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS),
                Tag("token_id_lists")],
    Discriminator(_prompt_form),
]


class SamplingRequest(RequestBody):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: SampleCount = 1
    best_of: SampleCount | None = None
    """Samples generated per prompt, of which the n most likely are returned (not streamable if > n)."""
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Int64 | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: LogitBias | None = None
    """Token id (a decimal string) -> value added to its logit."""
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOKEN_COUNT), INTEGRAL] | None = None
    """0 or -1 disables top-k."""
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: Annotated[int, Field(ge=0, le=MAX_TOKEN_COUNT), INTEGRAL] = 0
    ignore_eos: bool = False
    repetition_penalty: float | None = Field(None, gt=0.0)
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    """False: with skip_special_tokens false, consecutive added tokens are joined without the space some decoders
    (WordPiece's) put between tokens."""
    include_stop_str_in_output: bool = False
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    bad_words: Annotated[list[str], Field(max_length=MAX_BAD_WORDS)] | None = None
    priority: Int64 = 0
    """Lower runs first, with --scheduling-policy priority."""
    return_tokens_as_token_ids: bool | None = None
    """Logprobs name tokens 'token_id:N' rather than by their text; unset: the server's
    --return-tokens-as-token-ids."""
    prompt_logprobs: NumLogprobsOrAll | None = None
    """vLLM's: the logprob of each prompt token (null for the first) and of the N most likely at its place, as
    {token id: {logprob, rank, decoded_token}}; in each completion choice, at the top of a chat completion. Not
    streamable."""
    return_token_ids: bool = False
    """The answer carries token ids too (vLLM's): the prompt's (prompt_token_ids: in each completion choice, at the
    top of a chat completion; streamed, in the first chunk) and each choice's generated ones (token_ids; streamed,
    those of each chunk)."""
    cache_salt: str | None = None
    use_beam_search: bool = False
    """vLLM's: beam search, n beams wide, instead of sampling; the n best beams are the choices, best first. Sampling
    fields are refused with it (best_of but n; temperature is taken, as vLLM's, and leaves the beams as they are);
    streamed, the answer comes whole at the end."""
    length_penalty: float = 1.0
    """With use_beam_search: beams are ranked by cumulative logprob / length ** length_penalty."""
    request_id: str | None = None
    """vLLM's: the request's id, which the response's id carries ("cmpl-<id>", "chatcmpl-<id>") and the log names; an
    X-Request-Id header, when given, comes first (as in vLLM). Need not be unique."""
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=MAX_TOKEN_COUNT), INTEGRAL] | None = None
    """vLLM's: only the prompt's last k tokens are kept (those of the rendered conversation, in chat); -1: as many as
    leave room for max_tokens (for 1 token if unset). -1 or 1 up to the model's context length."""
    # Structured outputs: at most one of response_format (other than text), structured_outputs and the
    # guided_* aliases; a second one is a 400, as is a schema, regex or grammar that does not compile.
    response_format: ResponseFormat | None = None
    """{"type": "text"} (the default), {"type": "json_object"}, or {"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}}}: the output is then a JSON object, or a JSON value valid for the schema;
    or vLLM's {"type": "structural_tag", "format": {...}} (or with structures and triggers): free text with
    structured parts."""
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    """vLLM's older name of structured_outputs.json (likewise guided_regex, guided_choice, guided_grammar)."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    """Accepted and ignored: the server's --structured-outputs-config picks the backend."""
    guided_whitespace_pattern: str | None = None
    """Not supported: a 400 unless null or absent (whitespace in JSON output follows --structured-outputs-config)."""
    structural_tag: str | dict[str, Any] | None = None
    """vLLM's older name of structured_outputs.structural_tag."""
    # vLLM's extras this server has no counterpart for: each a 400 naming it unless null, absent or empty (see
    # sampling.UNSUPPORTED), rather than ignored.
    logits_processors: Any = None
    """Not supported (no per-request logits processors)."""
    kv_transfer_params: Any = None
    """Not supported (no disaggregated prefill)."""
    vllm_xargs: Any = None
    """Not supported (no extensions to read them)."""
    mm_processor_kwargs: Any = None
    """Not supported (text-only models)."""


class CompletionRequest(SamplingRequest):
    prompt: Prompt = Field(description=f"Text, a list of texts, token ids, or a list of token-id lists; at most "
                                       f"{MAX_PROMPTS} prompts, and prompts times best_of (or n) at most "
                                       f"{MAX_SEQUENCES}.")
    max_tokens: Annotated[int, Field(ge=0, le=MAX_TOKEN_COUNT), INTEGRAL] | None = 16
    """0 only with echo: the prompt is scored, not continued (its text, and with logprobs its tokens' logprobs)."""
    echo: bool = False
    logprobs: NumLogprobs | None = None
    suffix: str | None = None
    """Not supported (no fill-in-the-middle): a 400 unless null or absent."""
    # vLLM's completion extras
    add_special_tokens: bool = True
    """The tokenizer adds its special tokens (a BOS, for most models) to text prompts; token-id prompts are taken as
    they are."""
    prompt_embeds: Any = None
    """Not supported (prompts are text or token ids): a 400 unless null, absent or empty."""


class ChatCompletionRequest(SamplingRequest):
    messages: Messages
    max_tokens: TokenCount | None = None
    """Deprecated by OpenAI in favour of max_completion_tokens; both are honoured."""
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobsOrAll | None = None
    tools: list[ChatTool] | None = None
    """Function tools, passed to the chat template."""
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Absent: "auto" with tools, "none" without. "required" and a named function are enforced with structured
    outputs; "auto" needs the server's --enable-auto-tool-choice and --tool-call-parser."""
    parallel_tool_calls: bool = True
    """False: at most one call."""
    functions: Any = None
    """OpenAI's deprecated form of tools: not supported, a 400 unless null or absent (vLLM ignores it)."""
    function_call: Any = None
    """OpenAI's deprecated form of tool_choice: likewise a 400 unless null or absent."""
    # vLLM's chat extras
    echo: bool = False
    """The answer's content starts with the last message's, if that message has the answer's role (an assistant
    message continued with add_generation_prompt false, say); streamed, in a chunk of its own after the role's."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    """The tokenizer's special tokens (a BOS) added on top of those the chat template writes (most templates write
    the BOS themselves: true then doubles it)."""
    chat_template: str | None = None
    """A Jinja chat template to use instead of the model's; refused unless the server was started with
    --trust-request-chat-template."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template; not those the server passes itself (messages, tools, chat_template,
    add_generation_prompt, continue_final_message, tokenize)."""
    thinking_token_budget: Annotated[int, Field(ge=-1, le=MAX_TOKEN_COUNT), INTEGRAL] | None = None
    """vLLM's cap on reasoning tokens: at most this many between the reasoning markers (--reasoning-parser's, or
    --reasoning-config's), then the end marker is forced; -1 or null: no cap."""
    include_reasoning: bool = True
    """vLLM's: false leaves the reasoning (what --reasoning-parser splits off) out of the answer, which then has no
    reasoning_content; the content is the same."""
    documents: list[dict[str, str]] | None = None
    """vLLM's: documents for retrieval-augmented generation, the chat template's `documents` (each best with "title"
    and "text"); a template that does not read them ignores them."""
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    """The chat template's `reasoning_effort`, as in vLLM; with it, `enable_thinking` is true unless it is "none"
    (unless chat_template_kwargs sets enable_thinking). A template that reads neither ignores it."""


class TokenizeRequest(RequestBody):
    """Pass exactly one of prompt and messages."""

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    tools: list[ChatTool] | None = None
    add_special_tokens: bool | None = None
    """The tokenizer's special tokens (a BOS) added; unset: true for a prompt, false for messages (whose chat template
    writes them), as vLLM's."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    """As a chat completion's: messages render exactly as there (serving_chat.render_messages)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """As a chat completion's."""
    return_token_strs: bool = False
    """Also answer each token's string (`token_strs`), as the tokenizer's vocabulary spells it."""


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]


REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
