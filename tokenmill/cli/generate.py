"""`tokenmill generate "prompt"`: one-shot generation with the offline engine, printed to stdout."""

from __future__ import annotations

import argparse
import dataclasses

from tokenmill.cli.args import (
    add_dataclass_args,
    add_engine_args,
    add_generation_config_arg,
    check_text_prompts,
    cli_sampling_params,
    engine_kwargs_from_args,
    given_fields,
)
from tokenmill.engine.generation_config import READ_KEYS
from tokenmill.sampling_params import SamplingParams

SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop",
                  "ignore_eos", "min_tokens")
"""The sampling fields offered as flags (--seed is the engine's: it seeds unseeded sampling)."""

SAMPLING_HELP = {
    "top_p": "Sample from the most likely tokens whose probabilities add up to top_p.",
    "stop": "Stop generating when one of these strings appears.",
    "ignore_eos": "Keep generating past the end-of-sequence token.",
}
"""Help of the sampling flags whose field has no docstring."""

FALLBACK = {"max_tokens": 128}
"""Where neither a flag nor the model sets one: SamplingParams' 16 tokens are too few to try a model."""


def register(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate text for prompts, offline (no server)")
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text (several run as one batch)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    # Flags left out take the model's defaults, as vLLM's requests do: they stay unset here.
    from_model = {name: f"the model's generation_config.json, else {FALLBACK.get(name, _default(name))}"
                  for name in READ_KEYS.values() if name in SAMPLING_FLAGS}
    sampling = parser.add_argument_group("sampling")
    add_dataclass_args(sampling, SamplingParams, only=SAMPLING_FLAGS, helps=SAMPLING_HELP, unset=from_model)
    add_generation_config_arg(sampling)
    add_engine_args(parser, model_positional=False)
    parser.set_defaults(handler=run)


def _default(name: str):
    return next(f.default for f in dataclasses.fields(SamplingParams) if f.name == name)


def sampling_params_from_args(args: argparse.Namespace, model_defaults: dict) -> SamplingParams:
    """The flags given, over the model's defaults (LLM.sampling_defaults), over FALLBACK."""
    return cli_sampling_params(model_defaults, given_fields(args, SamplingParams, only=SAMPLING_FLAGS), FALLBACK)


def run(args: argparse.Namespace) -> int:
    from tokenmill import LLM

    model, engine_kwargs = engine_kwargs_from_args(args)
    # The flags checked before the model loads; max_tokens, which may come from the model, not yet limiting.
    SamplingParams(**{"max_tokens": None, **given_fields(args, SamplingParams, only=SAMPLING_FLAGS)})
    check_text_prompts(engine_kwargs, "generate")
    empty = [str(i) for i, prompt in enumerate(args.prompts, 1) if not prompt]
    if empty:  # the engine refuses them too, but only once the model has loaded
        raise ValueError(f"prompt {', '.join(empty)} of {len(args.prompts)} is empty: give text to continue")
    llm = LLM(model, generation_config=args.generation_config, **engine_kwargs)
    params = sampling_params_from_args(args, llm.sampling_defaults)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, output in zip(args.prompts, outputs):
        text = output.outputs[0].text
        print(f"{prompt}\n{'-' * 8}\n{text}" if args.chat else prompt + text, flush=True)
        if len(outputs) > 1:
            print("=" * 40)
    return 0
