"""Validate and tokenize user prompts into EngineRequests, before anything is scheduled."""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any, TypedDict

from transformers import PreTrainedTokenizerBase

from tokenmill.config import ReasoningConfig, StructuredOutputsConfig
from tokenmill.engine.tokenizer import TokenizerInfo, check_unicode
from tokenmill.protocol import EngineRequest
from tokenmill.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    SamplingParams,
    StructuredOutputsParams,
    as_token_ids,
)
from tokenmill.structured.grammar import validate as validate_structured_outputs
from tokenmill.structured.vocab import grammar_vocab_size


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]
    prompt: str
    cache_salt: str
    """As the cache_salt argument, for this prompt alone (vLLM's prompt key)."""


PROMPT_KEYS = frozenset(TokensPrompt.__annotations__)


PromptType = str | TokensPrompt | dict[str, Any]


class InputProcessor:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase | None, tokenizer_info: TokenizerInfo,
        max_model_len: int, vocab_size: int, structured_outputs: StructuredOutputsConfig | None = None,
        max_logprobs: int = 20, reasoning: ReasoningConfig | None = None,
    ) -> None:
        """`structured_outputs`: the engine's structured_outputs_config, for what a spec leaves unset (None: the
        defaults); `max_logprobs`: the most logprobs a request may ask for (-1: the vocabulary size); `reasoning`:
        the engine's reasoning_config, whose markers a thinking_token_budget counts between."""
        self.tokenizer = tokenizer
        self.structured_outputs = structured_outputs or StructuredOutputsConfig()
        self.tokenizer_info = tokenizer_info
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = vocab_size if max_logprobs == -1 else max_logprobs
        # The ids grammars compile against (structured/vocab.py). Read now: later, the tokenizer may be busy on
        # another thread.
        self.grammar_vocab_size = grammar_vocab_size(tokenizer, vocab_size) if tokenizer is not None else vocab_size
        self.thinking_markers: tuple[list[int], list[int]] | None = None
        """The reasoning markers' token ids (start, end), where the engine has markers and a tokenizer."""
        if reasoning is not None and reasoning.has_markers and tokenizer is not None:
            self.thinking_markers = tuple(tokenizer.encode(text, add_special_tokens=False) for text in
                                          (reasoning.reasoning_start_str, reasoning.reasoning_end_str))
            if not all(self.thinking_markers):
                raise ValueError(f"reasoning_config's markers {reasoning} tokenize to no token")

    def tokenize_prompt(self, prompt: PromptType, tokenizer: PreTrainedTokenizerBase | None = None,
                        add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(text, token ids); `tokenizer`: another copy of the engine's, for a thread of its own. add_special_tokens:
        whether the tokenizer adds its special tokens (a BOS) to a text prompt; token ids are taken as they are."""
        if isinstance(prompt, str):
            text, token_ids = prompt, None
        elif isinstance(prompt, dict) and ("prompt_token_ids" in prompt or "prompt" in prompt):
            text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        else:
            raise TypeError(f"a prompt must be a string or a dict with 'prompt' or 'prompt_token_ids', got {prompt!r}")
        if isinstance(prompt, dict) and (unknown := sorted(map(str, prompt.keys() - PROMPT_KEYS))):
            # Ignored, an image would go unseen and a cache salt keep nothing apart.
            raise ValueError(f"a prompt's {', '.join(unknown)} is not supported (a prompt takes "
                             f"{', '.join(sorted(PROMPT_KEYS))})")
        if token_ids is None:
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass prompt_token_ids")
            if not isinstance(text, str):
                raise ValueError(f"a prompt's 'prompt' must be a string, got {text!r}")
            check_unicode(text, "the prompt")
            return text, (tokenizer if tokenizer is not None else self.tokenizer).encode(
                text, add_special_tokens=add_special_tokens)
        # Plain ints (numpy's and 0-d tensors' too): a float got past the range check and failed later.
        return text, as_token_ids(token_ids, "prompt_token_ids")

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> tuple[str | None, EngineRequest]:
        text, token_ids = self.tokenize_prompt(prompt)
        if isinstance(prompt, dict) and "cache_salt" in prompt:
            if cache_salt is not None and cache_salt != prompt["cache_salt"]:
                raise ValueError("the prompt's cache_salt and the cache_salt argument differ: give one")
            cache_salt = prompt["cache_salt"]
        if (keep := params.truncate_prompt_tokens) is not None:
            token_ids = token_ids[-(self.max_model_len - 1 if keep == -1 else keep):]
        spec = self.validate(token_ids, params)
        if not INT64_MIN <= priority <= INT64_MAX:
            raise ValueError(f"priority must fit in 64 bits, got {priority}")
        if params.bad_words and not params.bad_words_token_ids:
            # A copy: the caller's params may go to another engine, whose tokenizer gives other ids.
            params = dataclasses.replace(params, bad_words_token_ids=self._tokenize_bad_words(params.bad_words))
        if params.thinking_token_budget is not None and (
                (params.thinking_start_token_ids, params.thinking_end_token_ids) != self.thinking_markers):
            # Always the engine's: the worker's machines share one pair of markers. A copy, as above.
            start, end = self.thinking_markers
            params = dataclasses.replace(params, thinking_start_token_ids=start, thinking_end_token_ids=end)
        if -1 in (params.logprobs, params.prompt_logprobs):
            # The core takes counts: -1 is the whole vocabulary. A copy, as below.
            params = dataclasses.replace(params, **{name: self.vocab_size for name in ("logprobs", "prompt_logprobs")
                                                    if getattr(params, name) == -1})
        if spec is not params.structured_outputs:
            # As the compiler builds it: its backend and the engine's options. A copy, as above (a shallow one:
            # the params were validated, and `replace` would check them all again).
            params = copy.copy(params)
            params.structured_outputs = spec
        request = EngineRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.tokenizer_info.eos_token_ids,
            arrival_time=arrival_time or time.time(),
            priority=priority,
            cache_salt=cache_salt,
        )
        return text, request

    def validate(self, token_ids: list[int], params: SamplingParams) -> StructuredOutputsParams | None:
        """ValueError naming what is wrong; else the structured outputs as they are enforced
        (`check_structured_outputs`; None without)."""
        params.validate()
        if not token_ids:
            raise ValueError("the prompt is empty")
        self._check_token_ids(token_ids, "prompt token ids")
        self._check_token_ids(params.stop_token_ids, "stop_token_ids")
        self._check_token_ids(params.allowed_token_ids or [], "allowed_token_ids")
        self._check_token_ids(list(params.logit_bias or {}), "logit_bias keys")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value == -1 and self.max_logprobs < self.vocab_size:
                raise ValueError(f"{name} -1 asks for the whole vocabulary ({self.vocab_size} tokens), more than the "
                                 f"engine's max_logprobs ({self.max_logprobs}); allowed where max_logprobs is -1")
            if (value or 0) > self.vocab_size:
                raise ValueError(f"{name} must be at most the vocabulary size ({self.vocab_size}), got {value}")
            if (value or 0) > self.max_logprobs:
                raise ValueError(f"{name} must be at most {self.max_logprobs} (the engine's max_logprobs), got "
                                 f"{value}")
        if params.allowed_token_ids is not None or params.logit_bias:
            self._check_an_allowed_token_is_left(params)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this engine has none: use stop_token_ids")
        if params.stop and not params.detokenize:
            raise ValueError("stop strings cannot be combined with detokenize=False: they are matched in the text")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer, and this engine has none")
        if params.thinking_token_budget is not None and self.thinking_markers is None:
            raise ValueError(
                "thinking_token_budget needs the reasoning block's markers: the engine's reasoning_config "
                "(--reasoning-config '{\"reasoning_start_str\": \"<think>\", \"reasoning_end_str\": \"</think>\"}', "
                "which `tokenmill serve --reasoning-parser NAME` sets from its parser)"
                if self.tokenizer is not None else "thinking_token_budget needs a tokenizer, and this engine has none")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need a tokenizer, and this engine has none")
            spec = self.check_structured_outputs(params.structured_outputs)
            refuse_past_the_structure(params)
        else:
            spec = None
        num = len(token_ids)
        if num >= self.max_model_len:
            raise ValueError(
                f"the prompt has {num} tokens, but the model's context length (max_model_len) is "
                f"{self.max_model_len}, which leaves no room for output"
            )
        return spec

    def check_structured_outputs(self, spec: StructuredOutputsParams) -> StructuredOutputsParams:
        """ValueError for a spec that would not compile: its grammar does not build, or it names a token id past the
        vocabulary the grammars are compiled against (a structural tag's token format, an EBNF Token()); else the
        spec as it is enforced: what it leaves unset taken from the engine's structured_outputs_config, its backend
        resolved (the spec itself if nothing changed)."""
        config = self.structured_outputs
        changes = {name: getattr(config, name) for name in _ENGINE_OPTIONS if getattr(spec, name) is None}
        # A schema or tag given as a dict is kept as its JSON text, written once: the key every cache lookup and
        # the compile take (json.dumps of it again at each was most of a cached spec's cost).
        for name in ("json", "structural_tag"):
            if getattr(spec, name) is not None and not isinstance(getattr(spec, name), str):
                changes[name] = spec.key[1]
        if changes:
            spec = dataclasses.replace(spec, **changes)
        backend, token_ids = validate_structured_outputs(spec, config.backend)
        if past := [t for t in token_ids or () if t >= self.grammar_vocab_size]:
            raise ValueError(f"the structured outputs name the token id {past[0]}, past the vocabulary "
                             f"(ids in [0, {self.grammar_vocab_size}))")
        if spec.backend == backend:
            return spec
        if changes:  # our copy (the caller's spec is never changed)
            spec.backend = backend
            return spec
        return dataclasses.replace(spec, backend=backend)

    def _check_token_ids(self, token_ids: list[int], what: str) -> None:
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= self.vocab_size):  # C loops: a prompt is long
            raise ValueError(f"{what} must be in [0, {self.vocab_size})")

    def _check_an_allowed_token_is_left(self, params: SamplingParams) -> None:
        """A row whose every logit is masked has no token to sample (the draw would return one outside every
        constraint): refuse the requests where that is known before they start."""
        banned = {t for t, bias in (params.logit_bias or {}).items() if bias == float("-inf")}
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.tokenizer_info.eos_token_ids))
        if params.allowed_token_ids is None and len(banned) + len(stops) < self.vocab_size:
            return  # tokens enough are left (the usual case: no set of the whole vocabulary built)
        left = set(params.allowed_token_ids or range(self.vocab_size)) - banned
        if not left:
            raise ValueError("logit_bias of -inf bans every token" if params.allowed_token_ids is None else
                             "logit_bias of -inf cannot be combined with allowed_token_ids that it bans all of")
        if params.min_tokens and left <= stops:
            raise ValueError("min_tokens cannot be combined with allowed_token_ids that are all stop or EOS tokens: "
                             "min_tokens masks them" if params.allowed_token_ids is not None else
                             "min_tokens cannot be combined with a logit_bias of -inf on every token but stop and EOS "
                             "tokens: min_tokens masks them")

    def _tokenize_bad_words(self, words: list[str]) -> list[list[int]]:
        """Each word as it would appear mid-text and at the start of text (they tokenize differently)."""
        assert self.tokenizer is not None
        sequences: dict[tuple[int, ...], None] = {}  # in order, each once (a list's `in` made this quadratic)
        for word in words:
            check_unicode(word, "a bad word")
            for variant in (word.lstrip(), " " + word.lstrip()):  # as vLLM: the word's own leading space aside
                if ids := self.tokenizer.encode(variant, add_special_tokens=False):
                    sequences[tuple(ids)] = None
        return [list(ids) for ids in sequences]


_ENGINE_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")
"""A spec's options that the engine's structured_outputs_config gives when the spec leaves them unset."""


def refuse_past_the_structure(params: SamplingParams) -> None:
    """A structure ends with an EOS token (the grammar allows nothing else there): ignore_eos would go on past it
    unconstrained, and min_tokens would mask the only token the grammar allows (the row then has none left)."""
    if params.ignore_eos:
        raise ValueError("ignore_eos cannot be combined with structured outputs: the output ends where the "
                         "structure does")
    if params.min_tokens:
        raise ValueError("min_tokens cannot be combined with structured outputs: the structure decides where the "
                         "output ends")
