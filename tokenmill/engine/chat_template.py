"""Conversations -> prompt text and token ids, through the model's Jinja chat template."""

from __future__ import annotations

import functools
import json
from typing import Any

import jinja2
import jinja2.nodes
from transformers import PreTrainedTokenizerBase

from tokenmill.config import CONTENT_FORMATS
from tokenmill.engine.tokenizer import check_unicode


def normalize_messages(messages: list[dict[str, Any]], content_format: str = "string") -> list[dict[str, Any]]:
    """OpenAI messages as chat templates take them: text content only (one string, or with `content_format` 'openai'
    a list of text parts; refusal parts are text), and assistant tool calls' arguments as objects (OpenAI sends them
    as JSON text)."""
    conversation = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in ("text", "refusal") or not isinstance(part.get(kind), str):
                    raise ValueError(f"messages[{i}]: only text content parts are supported")
                texts.append(part[kind])
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        else:
            texts = [] if content is None else [content]
        if content_format == "openai":
            content = [{"type": "text", "text": text} for text in texts]
        else:
            content = content if isinstance(content, str) else "\n".join(texts)
        message = {**message, "content": content}
        if message.get("tool_calls"):
            message["tool_calls"] = [_call_with_object_arguments(call, f"messages[{i}].tool_calls[{j}]")
                                     for j, call in enumerate(message["tool_calls"])]
        conversation.append(message)
    return conversation


def resolve_content_format(content_format: str, tokenizer: PreTrainedTokenizerBase, chat_template: str | None,
                           tools: list[dict[str, Any]] | None = None) -> str:
    """'string' or 'openai': `content_format` itself, or for 'auto' what the template that renders reads."""
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {' | '.join(CONTENT_FORMATS)}, got "
                         f"{content_format!r}")
    if content_format != "auto":
        return content_format
    try:
        template = tokenizer.get_chat_template(chat_template, tools)
    except ValueError:  # no template: render_chat says so
        return "string"
    return "openai" if loops_over_content(template) else "string"


@functools.lru_cache(maxsize=32)
def loops_over_content(template: str) -> bool:
    """Whether a chat template loops over a message's content (`{% for part in message['content'] %}`, directly or
    through a variable set to it): such a template reads OpenAI's list of parts."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        environment = _compile_jinja_template(template).environment  # its extensions ({% generation %} tags)
    except Exception:  # a template transformers cannot compile fails when it renders, where the error is said
        environment = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        tree = environment.parse(template)
    except jinja2.TemplateError:
        return False
    content_names = {node.target.name for node in tree.find_all(jinja2.nodes.Assign)
                     if isinstance(node.target, jinja2.nodes.Name) and _is_content(node.node, set())}
    return any(_is_content(loop.iter, content_names) for loop in tree.find_all(jinja2.nodes.For))


def _is_content(node: jinja2.nodes.Node, names: set[str]) -> bool:
    """`x.content`, `x['content']`, a variable holding one, or either through filters (`message.content | list`)."""
    while isinstance(node, jinja2.nodes.Filter) and node.node is not None:
        node = node.node
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    return isinstance(node, jinja2.nodes.Name) and node.name in names


def object_arguments(arguments: Any) -> dict[str, Any] | None:
    """A tool call's arguments as the object the templates take (given as one or as its JSON text); None when they
    are not a JSON object."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return arguments if isinstance(arguments, dict) else None


def _call_with_object_arguments(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    arguments = object_arguments(function.get("arguments") if isinstance(function, dict) else None)
    if arguments is None:
        raise ValueError(f"{where}.function.arguments must be a JSON object")
    return {**call, "function": {**function, "arguments": arguments}}


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    conversation: list[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    **template_kwargs: Any,
) -> tuple[str, list[int]]:
    """The prompt text and its token ids; ValueError when the template cannot render the conversation.
    add_special_tokens: the tokenizer's special tokens (a BOS) added on top of those the template wrote."""
    text = render_chat_text(tokenizer, conversation, chat_template, add_generation_prompt, continue_final_message,
                            **template_kwargs)
    # The rendered text already holds the special tokens (BOS) the template wants: by default none are added.
    return text, tokenizer.encode(text, add_special_tokens=add_special_tokens)


def render_chat_text(
    tokenizer: PreTrainedTokenizerBase,
    conversation: list[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    **template_kwargs: Any,
) -> str:
    """render_chat's prompt text alone."""
    if chat_template is None and tokenizer.chat_template is None:
        raise ValueError("the model has no chat template; pass one (--chat-template FILE)")
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            tokenize=False,
            **template_kwargs,
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template failed: {e}") from e
    check_unicode(text, "the rendered conversation")
    return text
