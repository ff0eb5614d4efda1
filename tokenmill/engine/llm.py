"""Offline API: LLM.generate() and LLM.chat() over an in-process engine, outputs in input order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from tokenmill.config import EngineConfig
from tokenmill.engine.beam_search import BeamSearchOutput, beam_search
from tokenmill.engine.chat_template import normalize_messages, render_chat, resolve_content_format
from tokenmill.engine.generation_config import sampling_defaults
from tokenmill.engine.input_processor import PromptType
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, generation_config: str = "auto",
                 override_generation_config: dict[str, Any] | None = None, disable_log_stats: bool = True,
                 **engine_args: Any) -> None:
        """generation_config: where generate() and chat() called without sampling_params take their sampling
        parameters from, as vLLM's: 'auto' the model folder's generation_config.json (temperature, top_p, top_k,
        min_p, repetition_penalty, max_new_tokens as max_tokens), 'vllm' none (SamplingParams()), or a folder's;
        override_generation_config: keys of that file set on top of it; disable_log_stats: vLLM's, taken for its
        callers' sake (offline, tokenmill logs no periodic stats; the server does, as vLLM's)."""
        if model is None:
            from tokenmill.default_model import default_model_path

            model = default_model_path()
        # Before the model loads: a missing folder or a bad value fails at once.
        self._sampling_defaults = sampling_defaults(generation_config, model, override_generation_config)
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_args))

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The sampling parameters generation_config sets (a copy): those get_default_sampling_params() does not
        leave at SamplingParams' own defaults."""
        return dict(self._sampling_defaults)

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() sample with when given no sampling_params (a new object each call: the
        caller may change it); sampling_params given are used as they are, with none of these merged in."""
        return SamplingParams(**self._sampling_defaults)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        cache_salt: str | list[str | None] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._per_prompt(self.get_default_sampling_params() if sampling_params is None else sampling_params,
                                  len(prompts), "sampling_params")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams (or a list of them, one a prompt), got {p!r}")
        salts = self._per_prompt(cache_salt, len(prompts), "cache_salt")
        priorities = self._per_prompt(0 if priority is None else priority, len(prompts), "priority")
        # Validate everything before scheduling anything: a bad prompt fails the call cleanly.
        request_ids = []
        try:
            for prompt, p, prio, salt in zip(prompts, params, priorities, salts):
                request_id = self.engine.next_request_id()
                self.engine.add_request(
                    request_id, prompt, p, priority=prio, cache_salt=salt, output_kind=RequestOutputKind.FINAL_ONLY
                )
                request_ids.append(request_id)
        except Exception:
            self.engine.abort_request(request_ids)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template_content_format: str = "auto",
    ) -> list[RequestOutput]:
        """`tools` and `chat_template_kwargs` (enable_thinking=False, ...) go to the template, as in vLLM;
        `chat_template_content_format`: how message content reaches it (auto, string or openai: CONTENT_FORMATS)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer, and this engine has none")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        template_kwargs = {**(chat_template_kwargs or {}), **({"tools": tools} if tools is not None else {})}
        content_format = resolve_content_format(chat_template_content_format, tokenizer, chat_template, tools)
        prompts = []
        for conversation in conversations:
            # OpenAI's forms, as the server takes them: content as one string or a list of text parts.
            text, token_ids = render_chat(tokenizer, normalize_messages(conversation, content_format), chat_template,
                                          add_generation_prompt, continue_final_message, **template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """Best `beam_width` sequences per prompt; see tokenmill/engine/beam_search.py."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"beam_search takes BeamSearchParams, got {params!r}")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        token_prompts = [self.engine.input_processor.tokenize_prompt(p)[1] for p in prompts]
        outputs = beam_search(
            lambda batch, sp, salts: self.generate(batch, sp, use_tqdm=False, cache_salt=salts),
            token_prompts, params, self.engine.input_processor.tokenizer_info.eos_token_ids,
            self.engine.max_model_len, [p.get("cache_salt") if isinstance(p, dict) else None for p in prompts],
        )
        tokenizer = self.engine.tokenizer
        if tokenizer is not None:
            for prompt, output in zip(token_prompts, outputs):
                for seq in output.sequences:
                    seq.text = tokenizer.decode(seq.tokens[len(prompt):], skip_special_tokens=True)
        return outputs

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        num_input = num_output = 0
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if not output.finished:
                        continue
                    finished[output.request_id] = output
                    num_input += len(output.prompt_token_ids)
                    num_output += sum(len(c.token_ids) for c in output.outputs)
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    bar.set_postfix_str(f"est. speed input: {num_input / elapsed:.1f} toks/s, "
                                        f"output: {num_output / elapsed:.1f} toks/s", refresh=False)
                    bar.update(1)
        return [finished[rid] for rid in request_ids]

    @staticmethod
    def _per_prompt(value, num_prompts: int, name: str) -> list:
        if isinstance(value, (list, tuple)):
            if len(value) != num_prompts:
                raise ValueError(f"{name} has {len(value)} entries for {num_prompts} prompts")
            return list(value)
        return [value] * num_prompts
