"""How far a quantized model's next-token predictions are from the unquantized model's, on a fixed text.

Both engines score the same token ids (prompt logprobs, teacher-forced): at each position the reference's
top-k distribution is compared with the candidate's. KL(reference || candidate) is summed over the
reference's top-k tokens, which carry `covered_mass` of its probability; a token missing from the
candidate's top-k takes the candidate's k-th logprob, an upper bound of its own, so the figure errs low
only by what lies outside both lists. Top-1 agreement: the two argmaxes are the same token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenmill.sampling_params import SamplingParams

TOP_K = 20


@dataclass(frozen=True)
class QuantQuality:
    positions: int
    top1_agreement: float
    mean_kl: float
    max_kl: float
    covered_mass: float

    def __str__(self) -> str:
        return (f"top-1 agreement {self.top1_agreement:.3f}, next-token KL mean {self.mean_kl:.4f} / max "
                f"{self.max_kl:.4f} nats over {self.positions} positions (top-{TOP_K}, "
                f"{self.covered_mass:.1%} of the mass)")


def prompt_distributions(llm, token_ids: list[int], top_k: int = TOP_K) -> list[dict[int, float]]:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k, detokenize=False)
    output = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
    dists = []
    for position in output.prompt_logprobs[1:]:
        # The prompt's own token comes too, whatever its rank: keep the top k.
        ranked = sorted(position.items(), key=lambda item: item[1].rank)[:top_k]
        dists.append({token: lp.logprob for token, lp in ranked})
    return dists


def compare(reference: list[dict[int, float]], candidate: list[dict[int, float]]) -> QuantQuality:
    kls, agree, mass = [], 0, 0.0
    for ref, cand in zip(reference, candidate, strict=True):
        floor = min(cand.values())
        kls.append(sum(math.exp(lp) * (lp - cand.get(token, floor)) for token, lp in ref.items()))
        agree += max(ref, key=ref.get) == max(cand, key=cand.get)
        mass += sum(math.exp(lp) for lp in ref.values())
    n = len(kls)
    return QuantQuality(n, agree / n, sum(kls) / n, max(kls), mass / n)


def quant_quality(reference_llm, candidate_llm, token_ids: list[int]) -> QuantQuality:
    return compare(prompt_distributions(reference_llm, token_ids), prompt_distributions(candidate_llm, token_ids))
