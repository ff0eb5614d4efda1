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


class BeamSearch:
    """The search itself, driven from outside: `step_prompts()` are the live beams, each to be run with
    `step_params`; `advance(outputs)` takes their outputs in the same order; once `done`, `results()`. LLM.beam_search
    drives it with generate(), the server with the async engine."""

    def __init__(self, prompts_token_ids: list[list[int]], params: BeamSearchParams, eos_token_ids: frozenset[int],
                 max_model_len: int) -> None:
        self.prompts = [list(p) for p in prompts_token_ids]
        self.params, self.eos_token_ids, self.max_model_len = params, eos_token_ids, max_model_len
        width = params.beam_width
        # As vLLM's: the step samples its token at the search's temperature; that token joins the candidates.
        self.step_params = SamplingParams(temperature=params.temperature, max_tokens=1, logprobs=2 * width,
                                          ignore_eos=True, detokenize=False)
        self.live = [[BeamSearchSequence(list(p))] for p in self.prompts]
        self.finished: list[list[BeamSearchSequence]] = [[] for _ in self.prompts]
        self.steps = 0
        self._flat: list[tuple[int, BeamSearchSequence]] = []

    @property
    def done(self) -> bool:
        return self.steps >= self.params.max_tokens or not any(self.live)

    def step_prompts(self) -> list[tuple[int, list[int]]]:
        """(prompt index, token ids) of each live beam."""
        self._flat = [(i, beam) for i, beams in enumerate(self.live) for beam in beams]
        return [(i, beam.tokens) for i, beam in self._flat]

    def advance(self, outputs: list[RequestOutput]) -> None:
        width, params, eos_token_ids = self.params.beam_width, self.params, self.eos_token_ids
        candidates: list[list[BeamSearchSequence]] = [[] for _ in self.prompts]
        for (i, beam), out in zip(self._flat, outputs, strict=True):
            for token_id, logprob in out.outputs[0].logprobs[0].items():
                candidates[i].append(BeamSearchSequence(
                    beam.tokens + [token_id], beam.logprobs + [logprob.logprob], beam.cum_logprob + logprob.logprob))
        for i, cands in enumerate(candidates):
            cands.sort(key=lambda s: s.cum_logprob, reverse=True)
            self.live[i] = []
            for cand in cands[:2 * width]:
                if not params.ignore_eos and cand.tokens[-1] in eos_token_ids:
                    cand.finish_reason = "stop"
                    self.finished[i].append(cand)
                elif len(self.live[i]) < width:
                    self.live[i].append(cand)
                if len(self.live[i]) == width:
                    break
            for beam in self.live[i]:
                if len(beam.tokens) >= self.max_model_len:
                    beam.finish_reason = "length"
            self.finished[i] += [b for b in self.live[i] if b.finish_reason]
            self.live[i] = [b for b in self.live[i] if not b.finish_reason]
        self.steps += 1

    def results(self) -> list[BeamSearchOutput]:
        results = []
        for i, prompt in enumerate(self.prompts):
            for beam in self.live[i]:
                beam.finish_reason = "length"
            ranked = sorted(self.finished[i] + self.live[i], reverse=True,
                            key=lambda s: beam_score(s, len(prompt), self.params.length_penalty, self.eos_token_ids))
            results.append(BeamSearchOutput(ranked[:self.params.beam_width]))
        return results


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
    search = BeamSearch(prompts_token_ids, params, eos_token_ids, max_model_len)
    while not search.done:
        beams = search.step_prompts()
        search.advance(generate([{"prompt_token_ids": tokens} for _, tokens in beams], search.step_params,
                                [salts[i] for i, _ in beams]))
    return search.results()
