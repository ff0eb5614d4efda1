"""What the frontend side of an engine loads of a model: config, context length, tokenizer and the
input/output processors. The engine core loads the weights; this never touches them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from transformers import PretrainedConfig, PreTrainedTokenizerBase

from tokenmill.config import ModelConfig, ReasoningConfig, StructuredOutputsConfig
from tokenmill.engine.input_processor import InputProcessor, PromptType
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.tokenizer import load_tokenizer, make_tokenizer_info
from tokenmill.layers.rotary import max_rope_positions
from tokenmill.model.loader import load_hf_config
from tokenmill.model.registry import get_model_class
from tokenmill.protocol import EngineRequest
from tokenmill.sampling_params import RequestOutputKind, SamplingParams


def resolve_max_model_len(requested: int | None, hf_config: PretrainedConfig) -> int:
    model_max = max_rope_positions(hf_config)  # max_position_embeddings, stretched by a linear or yarn RoPE scaling
    if requested is None:
        if model_max is None:
            raise ValueError("the model config has no max_position_embeddings: pass max_model_len")
        return model_max
    if model_max is not None and requested > model_max:
        pretrained = getattr(hf_config, "max_position_embeddings", None)
        raise ValueError(f"max_model_len={requested} exceeds the {model_max} positions the model serves "
                         f"(max_position_embeddings {pretrained} and its RoPE scaling): "
                         f"pass --max-model-len {model_max} or less (or leave it out)")
    return requested


@dataclass
class Frontend:
    hf_config: PretrainedConfig
    max_model_len: int
    tokenizer: PreTrainedTokenizerBase | None
    input_processor: InputProcessor
    output_processor: OutputProcessor

    def prepare(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        output_kind: RequestOutputKind | None = None,
    ) -> list[EngineRequest]:
        """Validate and tokenize, start tracking the outputs, and return the core request of each sample
        (one, or n / best_of of them). Raises ValueError for bad input before anything is tracked."""
        text, request = self.input_processor.process(request_id, prompt, params, priority, cache_salt)
        samples = self.output_processor.add_request(  # the request's params: the caller's, completed (bad words)
            request_id, text, request.prompt_token_ids, request.sampling_params, request.arrival_time, output_kind
        )
        requests = [replace(request, request_id=sid, sampling_params=sparams) for sid, sparams in samples]
        if len(requests) > 1 and params.prompt_logprobs is None:
            # The samples after the first share its prompt's KV instead of computing it again
            # (prompt logprobs need every prompt position's logits: such samples compute their own).
            requests[1:] = [replace(r, fork_of=requests[0].request_id) for r in requests[1:]]
        return requests


def load_frontend(model_config: ModelConfig, hf_config: PretrainedConfig | None = None,
                  structured_outputs: StructuredOutputsConfig | None = None,
                  reasoning: ReasoningConfig | None = None) -> Frontend:
    """`hf_config`: the model's, if the caller loaded it already; `structured_outputs`, `reasoning`: the engine's
    structured_outputs_config and reasoning_config."""
    hf_config = load_hf_config(model_config) if hf_config is None else hf_config
    get_model_class(hf_config.architectures)  # fail fast: before the tokenizer and weights load
    max_model_len = resolve_max_model_len(model_config.max_model_len, hf_config)
    tokenizer = None if model_config.skip_tokenizer_init else load_tokenizer(model_config, hf_config)
    tokenizer_info = make_tokenizer_info(tokenizer, hf_config, model_config)
    input_processor = InputProcessor(tokenizer, tokenizer_info, max_model_len, hf_config.vocab_size,
                                     structured_outputs, model_config.max_logprobs, reasoning)
    return Frontend(hf_config, max_model_len, tokenizer, input_processor, OutputProcessor(tokenizer))
