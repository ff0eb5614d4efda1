"""How the server turns a request's prompt into token ids, without an engine: vLLM's add_special_tokens, on a
tokenizer that adds a BOS (SmolLM2's, set to add one as Llama's does; as it comes, SmolLM2's adds none)."""

from __future__ import annotations

import copy

import pytest

from tokenmill.engine.chat_template import normalize_messages, render_chat
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.engine.tokenizer import TokenizerInfo
from tokenmill.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.server.serving_completion import split_prompts, tokenize_prompts

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def bos_tokenizer(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_bos_token = True
    assert tok.encode("Hi")[0] == tok.bos_token_id != tok.encode("Hi", add_special_tokens=False)[0]
    return tok


@pytest.mark.parametrize("given", [{}, {"add_special_tokens": True}, {"add_special_tokens": False}])
def test_completion_prompts_get_the_tokenizers_special_tokens_unless_asked_not_to(bos_tokenizer, given):
    # Before: the field was ignored (a warning in the log) and the BOS always added.
    req = CompletionRequest.model_validate({"prompt": ["Hi", "The sky"], **given})
    processor = InputProcessor(bos_tokenizer, TokenizerInfo(frozenset()), 1024, len(bos_tokenizer))
    prompts = tokenize_prompts(bos_tokenizer, processor, split_prompts(req.prompt), req.add_special_tokens)
    add = given.get("add_special_tokens", True)
    assert [p["prompt_token_ids"] for p in prompts] == [bos_tokenizer.encode(text, add_special_tokens=add)
                                                        for text in ("Hi", "The sky")]
    ids = bos_tokenizer.encode("Hi", add_special_tokens=False)  # token ids are the prompt as they are
    assert tokenize_prompts(bos_tokenizer, processor, split_prompts(ids), add)[0]["prompt_token_ids"] == ids


@pytest.mark.parametrize("given", [{}, {"add_special_tokens": True}])
def test_chat_adds_the_tokenizers_special_tokens_only_when_asked(bos_tokenizer, given):
    # Before: ignored. By default, as vLLM's, only the special tokens the template writes.
    req = ChatCompletionRequest.model_validate({"messages": HI, **given})
    text, ids = render_chat(bos_tokenizer, normalize_messages(HI), add_special_tokens=req.add_special_tokens)
    template_only = bos_tokenizer.encode(text, add_special_tokens=False)
    assert ids == ([bos_tokenizer.bos_token_id] + template_only if given else template_only)


PARTS_TEMPLATE = ("{% for m in messages %}{% if m.content is string %}S:{{ m.content }}{% else %}"
                  "{% for p in m['content'] %}P:{{ p.text }};{% endfor %}{% endif %}|{% endfor %}")
"""A template that reads a message's content either way, as the templates of multimodal models do."""


@pytest.mark.parametrize(("template", "loops"), [
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", False),
    (PARTS_TEMPLATE, True),
    ("{% for m in messages %}{% set c = m.content %}{% for p in c %}{{ p.text }}{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{% for p in m.content | selectattr('type', 'equalto', 'text') %}{{ p.text }}"
     "{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}", False),
])
def test_auto_content_format_is_openai_for_templates_that_loop_over_content(smollm2_tokenizer, template, loops):
    from tokenmill.engine.chat_template import loops_over_content, resolve_content_format

    assert loops_over_content(template) is loops
    assert resolve_content_format("auto", smollm2_tokenizer, template) == ("openai" if loops else "string")
    assert resolve_content_format("string", smollm2_tokenizer, PARTS_TEMPLATE) == "string"
    assert resolve_content_format("auto", smollm2_tokenizer, None) == "string"  # SmolLM2's own template
    with pytest.raises(ValueError, match="chat_template_content_format must be one of auto | string | openai"):
        resolve_content_format("parts", smollm2_tokenizer, None)


@pytest.mark.parametrize(("content_format", "rendered"), [("string", "S:a\nb|S:c|S:|"),
                                                          ("openai", "P:a;P:b;|P:c;||")])
def test_the_content_format_decides_what_the_template_gets(smollm2_tokenizer, content_format, rendered):
    # vLLM's: 'string' joins text parts with newlines (no content: ""); 'openai' gives text parts, a string content
    # as one part and no content as none.
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "refusal", "refusal": "b"}]},
                {"role": "assistant", "content": "c"}, {"role": "user", "content": None}]
    text, _ = render_chat(smollm2_tokenizer, normalize_messages(messages, content_format), PARTS_TEMPLATE,
                          add_generation_prompt=False)
    assert text == rendered
