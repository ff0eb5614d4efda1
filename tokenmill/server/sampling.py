"""OpenAI request fields -> SamplingParams, including the context-length check that names both numbers."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.server.errors import bad_request
from tokenmill.server.openai_protocol import SamplingRequest


def resolve_max_tokens(max_tokens: int | None, prompt_len: int, max_model_len: int, param: str,
                       prompt_param: str) -> int:
    """The output budget: what was asked for, if it fits the context, else a 400; all that fits if None.
    param, prompt_param: the request's fields of the two, which the 400 names."""
    room = max_model_len - prompt_len
    if room < 1:  # the prompt's fault whatever max_tokens is (completions' default of 16 included)
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens, and the prompt has "
            f"{prompt_len}: no room is left for output", param=prompt_param, code="context_length_exceeded",
        )
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens, but {prompt_len + max_tokens} "
            f"were requested ({prompt_len} in the prompt, {max_tokens} in {param}); reduce the prompt or {param}",
            param=param, code="context_length_exceeded",
        )
    return max_tokens


def truncate_prompt(token_ids: list[int], keep: int | None, requested: int | None, max_model_len: int) -> list[int]:
    """The prompt's last `keep` tokens (vLLM's truncate_prompt_tokens); -1: as many as leave room for the
    `requested` output (max_tokens; unset: 1 token)."""
    if keep is None:
        return token_ids
    if keep == 0 or keep > max_model_len:
        raise bad_request(f"truncate_prompt_tokens must be -1 or from 1 to the model's context length "
                          f"({max_model_len}), got {keep}", param="truncate_prompt_tokens")
    if keep == -1:
        keep = max(1, max_model_len - (requested or 1))
    return token_ids[-keep:]


def to_sampling_params(
    req: SamplingRequest,
    max_tokens: int,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
    skip_special_tokens: bool | None = None,
    keep_special_token_ids: list[int] | None = None,
    defaults: Mapping[str, Any] | None = None,
    max_logprobs: int | None = None,
    vocab_size: int | None = None,
) -> SamplingParams:
    """skip_special_tokens: overrides the request's (the server needs them to parse tool calls);
    keep_special_token_ids: those decoded even when skipped (a reasoning parser's markers). defaults: the
    values of the fields the request leaves unset, and a limit on max_tokens (generation_config.sampling_defaults).
    max_logprobs: the engine's (a 400 naming the field that asks for more); vocab_size: the model's, what -1 asks
    for."""
    defaults = defaults or {}
    for name, value in (("top_logprobs" if hasattr(req, "top_logprobs") else "logprobs", logprobs),
                        ("prompt_logprobs", prompt_logprobs)):
        if value == -1 and max_logprobs is not None and vocab_size is not None and max_logprobs < vocab_size:
            raise bad_request(f"{name} -1 asks for the whole vocabulary ({vocab_size} tokens), more than the "
                              f"server's --max-logprobs ({max_logprobs}); allowed where --max-logprobs is -1",
                              param=name)
        if max_logprobs is not None and value is not None and value > max_logprobs:
            raise bad_request(f"{name} must be at most {max_logprobs} (the server's --max-logprobs), got {value}",
                              param=name)

    def given_or_default(name: str, builtin: Any) -> Any:
        value = getattr(req, name)
        return defaults.get(name, builtin) if value is None else value

    try:
        return SamplingParams(
            n=req.n,
            best_of=req.best_of,
            temperature=given_or_default("temperature", 1.0),
            top_p=given_or_default("top_p", 1.0),
            top_k=given_or_default("top_k", 0),
            min_p=given_or_default("min_p", 0.0),
            seed=req.seed,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=given_or_default("repetition_penalty", 1.0),
            logit_bias=req.logit_bias,
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,
            max_tokens=min(max_tokens, defaults.get("max_tokens", max_tokens)),
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
            keep_special_token_ids=keep_special_token_ids,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            structured_outputs=structured_outputs,
            thinking_token_budget=getattr(req, "thinking_token_budget", None),
        )
    except ValueError as e:
        raise bad_request(str(e), param=field_named(str(e), type(req))) from e


def field_named(message: str, model: type[SamplingRequest]) -> str | None:
    """The request field a SamplingParams (or the engine's) error is about: its messages start with the field's
    name."""
    name = re.match(r"[a-z_]+", message)
    return name.group() if name is not None and name.group() in model.model_fields else None


UNSUPPORTED = {
    "logits_processors": "per-request logits processors are not supported by this server",
    "kv_transfer_params": "kv_transfer_params is not supported: this server does no disaggregated prefill",
    "vllm_xargs": "vllm_xargs is not supported: this server has no extensions that would read it",
    "mm_processor_kwargs": "mm_processor_kwargs is not supported: this server serves text-only models",
    "prompt_embeds": "prompt_embeds is not supported: send the prompt as text or token ids",
}
"""vLLM's extras with no counterpart here. Ignored, they would change nothing the client can see but the output it
expected (a logits processor's effect, a KV transfer); so each is a 400 unless null, absent or empty."""


def refuse_unsupported(req: SamplingRequest) -> None:
    for name, why in UNSUPPORTED.items():
        if getattr(req, name, None) not in (None, "", [], {}):
            raise bad_request(why, param=name)


def check_combinations(req: SamplingRequest) -> None:
    """400s for fields that are valid alone but not together, each naming the field to change."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", param="stream_options")
    if req.length_penalty != 1.0 and not req.use_beam_search:  # vLLM ignores it; the client meant a beam search
        raise bad_request("length_penalty only ranks beams: it needs use_beam_search", param="length_penalty")
    if req.stream and req.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs cannot be streamed", param="prompt_logprobs")
    if req.stream and req.best_of is not None and req.best_of > req.n:
        raise bad_request("best_of > n cannot be streamed: the best samples are known only at the end",
                          param="best_of")


def stream_usage(req: SamplingRequest, force: bool) -> tuple[bool, bool]:
    """Whether a stream ends with a usage chunk (stream_options' include_usage, or the server's
    --enable-force-include-usage), and whether every chunk carries the usage so far as well (vLLM's
    continuous_usage_stats, which, as there, takes include_usage too)."""
    options = req.stream_options
    final = force or (options is not None and options.include_usage)
    return final, final and options is not None and options.continuous_usage_stats
