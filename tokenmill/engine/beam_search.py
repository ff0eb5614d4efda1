"""Beam search on top of the engine: every step asks for one token and the top 2 * beam_width
logprobs of each live beam, then keeps the best beams. Beams are separate requests, so their
common prompt (and shared beam prefixes) come from the prefix cache instead of being recomputed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    tokens: list[int]
    """Prompt and generated tokens."""
    logprobs: list[float] = field(default_factory=list)
    """Logprob of each generated token."""
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]
    """Best first, by cumulative logprob / length ** length_penalty."""


def beam_score(seq: BeamSearchSequence, num_prompt_tokens: int, length_penalty: float, eos_ids: frozenset) -> float:
    """Cumulative logprob over the generated length to the power length_penalty (the final EOS not counted)."""
    length = len(seq.tokens) - num_prompt_tokens
    if seq.tokens and seq.tokens[-1] in eos_ids:
        length -= 1
    return seq.cum_logprob / max(length, 1) ** length_penalty


def beam_search(
    generate: Callable[[list[dict], SamplingParams, list[str | None]], list[RequestOutput]],
    prompts_token_ids: list[list[int]],
    params: BeamSearchParams,
    eos_token_ids: frozenset[int],
    max_model_len: int,
    cache_salts: list[str | None] | None = None,
) -> list[BeamSearchOutput]:
    """`generate(prompts, params, cache_salts)`; each beam is salted as its prompt is."""
    salts = cache_salts or [None] * len(prompts_token_ids)
    width = params.beam_width
    step_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * width, ignore_eos=True, detokenize=False)
    live = [[BeamSearchSequence(list(p))] for p in prompts_token_ids]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts_token_ids]
    for _ in range(params.max_tokens):
        flat = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not flat:
            break
        outputs = generate([{"prompt_token_ids": beam.tokens} for _, beam in flat], step_params,
                           [salts[i] for i, _ in flat])
        candidates: list[list[BeamSearchSequence]] = [[] for _ in prompts_token_ids]
        for (i, beam), out in zip(flat, outputs):
            for token_id, logprob in out.outputs[0].logprobs[0].items():
                candidates[i].append(BeamSearchSequence(
                    beam.tokens + [token_id], beam.logprobs + [logprob.logprob], beam.cum_logprob + logprob.logprob))
        for i, cands in enumerate(candidates):
            cands.sort(key=lambda s: s.cum_logprob, reverse=True)
            live[i] = []
            for cand in cands[:2 * width]:
                if not params.ignore_eos and cand.tokens[-1] in eos_token_ids:
                    cand.finish_reason = "stop"
                    done[i].append(cand)
                elif len(live[i]) < width:
                    live[i].append(cand)
                if len(live[i]) == width:
                    break
            for beam in live[i]:
                if len(beam.tokens) >= max_model_len:
                    beam.finish_reason = "length"
            done[i] += [b for b in live[i] if b.finish_reason]
            live[i] = [b for b in live[i] if not b.finish_reason]
    results = []
    for i, prompt in enumerate(prompts_token_ids):
        for beam in live[i]:
            beam.finish_reason = "length"
        ranked = sorted(done[i] + live[i], reverse=True,
                        key=lambda s: beam_score(s, len(prompt), params.length_penalty, eos_token_ids))
        results.append(BeamSearchOutput(ranked[:width]))
    return results
