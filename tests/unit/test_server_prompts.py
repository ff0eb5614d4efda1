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
