"""Conversations -> prompt text and token ids, through the model's Jinja chat template."""

from __future__ import annotations

import json
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase

from tokenmill.engine.tokenizer import check_unicode


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates take them: text content only (a list of text or refusal parts becomes one
    string), and assistant tool calls' arguments as objects (OpenAI sends them as JSON text)."""
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
            content = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        message = {**message, "content": content if content is not None else ""}
        if message.get("tool_calls"):
            message["tool_calls"] = [_call_with_object_arguments(call, f"messages[{i}].tool_calls[{j}]")
                                     for j, call in enumerate(message["tool_calls"])]
        conversation.append(message)
    return conversation


def _call_with_object_arguments(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    if not isinstance(arguments, dict):
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
    # The rendered text already holds the special tokens (BOS) the template wants: by default none are added.
    return text, tokenizer.encode(text, add_special_tokens=add_special_tokens)
