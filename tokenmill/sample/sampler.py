"""Sampler: logits -> one token per request, batched with per-request parameters.

The pipeline, in this fixed order (every stage is skipped when no row uses it):
  1. logprobs are taken from the raw model distribution (log_softmax of the unprocessed logits,
     as vLLM's default `raw_logprobs` mode; the logits themselves in `raw_logits` mode), before anything
     below changes the logits;
  2. per-request `logits_processors` (Python callables: the slow path);
  3. the logit mask: `logit_bias`, `allowed_token_ids`, `bad_words`, and EOS/stop tokens while
     fewer than `min_tokens` were generated;
  4. penalties: repetition (transformers' rule over prompt and output tokens), then frequency
     and presence (OpenAI's formula over output tokens); stages 2-4 compute in float32, and
     without them the draw reads the model's logits in their own dtype (so do the kernels when they
     apply the penalties as they load each logit: in batches without stages 2-3 and without top_k);
  5. greedy rows take the argmax here (ties: the lowest token id);
  6. temperature, then min_p, top_k and top_p (top_p renormalises over what min_p and top_k keep);
  7. the draw: on the kernels' path by inverse CDF (one uniform per row against the running sum of the
     probabilities in token-id order), on the CPU the same in a C kernel (sample/cpu_draw.py), elsewhere on
     torch's as argmax of probs / Exp(1) noise; no host sync.

Two implementations, one per device kind, with the same distribution:
- On CUDA with triton, Triton kernels (kernels/): the mask and penalties in one pass that reads each
  row's counts in place (or, in batches without a mask, processors or top_k, the penalties applied as
  the draw kernels load each logit); min_p and top_k as a per-row floor on the logits (the k-th largest value
  without a sort of the vocabulary; ties with it are kept); the draw over the candidates in one read
  of the logits plus one split per row, greedy rows in the same launch; rejection rounds instead of
  a sort for top_p. A row with a top_k of at most 256 is drawn among its gathered candidates instead,
  with the same uniforms and rounds, so the same token up to float rounding in the sums. The uniforms
  are keyed by the row's seed and the split layout by the vocabulary alone, so a seeded row's token
  depends on nothing else.
- Elsewhere, torch: when every sampled row has a top_k (up to 1024), on the top-k candidates only (a
  topk, no sort; ties at the k-th value are cut at k), else over the whole vocabulary. On the CPU the draw is a
  C kernel (sample/cpu_draw.py) that also applies min_p and top_p, top_p by the Triton kernels' rejection
  rounds (no sort; tokens tied with the nucleus' least likely member are in it); a seeded row's uniforms come
  from its own generator and candidates are drawn in token-id order, so both paths give the same token (up to
  float rounding in the sums). Without the C kernel (and on CUDA without triton), one sort serves top_k and
  top_p, and seeded rows draw their noise from their own generator, one value per token id on both paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.kernels import triton_available
from tokenmill.sample.cpu_argmax import argmax_applies, argmax_rows
from tokenmill.sample.cpu_draw import draw_applies, draw_rows, row_uniforms
from tokenmill.sample.metadata import SamplingMetadata

if TYPE_CHECKING:
    from tokenmill.kernels.penalties import Penalties


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [num_reqs] int64
    logprobs: LogprobsTensors | None = None


@dataclass
class LogprobsTensors:
    token_ids: torch.Tensor  # [num_reqs, 1 + k] sampled token first, then the top k
    logprobs: torch.Tensor  # [num_reqs, 1 + k] float32
    sampled_ranks: torch.Tensor  # [num_reqs] int64, 1 = the most likely token


def raw_scores(logits: torch.Tensor, logprobs_mode: str) -> torch.Tensor:
    """What a sampled token's logprobs are read from: the model's logits in float32 (raw_logits), or their
    log_softmax (raw_logprobs)."""
    return logits.float() if logprobs_mode == "raw_logits" else logits.float().log_softmax(dim=-1)


class Sampler(nn.Module):
    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        """logprobs_mode: ModelConfig.logprobs_mode."""
        super().__init__()
        self.logprobs_mode = logprobs_mode

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits [num_reqs, vocab] -> one token id per row (and logprobs if asked)."""
        wants_logprobs = metadata.max_num_logprobs is not None
        raw_logprobs = raw_scores(logits, self.logprobs_mode) if wants_logprobs else None
        penalties = penalties_on_load(metadata)
        row_maxima = None
        if penalties is None:
            logits, row_maxima = apply_logits_processors(logits, metadata)
        if metadata.all_greedy:
            token_ids = kernel_argmax(logits, penalties) if metadata.use_kernels else greedy_ids(logits)
        elif metadata.seeds is not None:
            token_ids = fused_draw(logits, metadata, row_maxima, penalties)
        else:
            token_ids = sample(logits, metadata)
            if metadata.is_greedy is not None:
                token_ids = torch.where(metadata.is_greedy, greedy_ids(logits), token_ids)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, token_ids, metadata.max_num_logprobs)
        return SamplerOutput(token_ids, logprobs)


def penalties_on_load(metadata: SamplingMetadata) -> Penalties | None:
    """The batch's penalties for the kernels to apply as they load each logit, where nothing needs the penalised
    logits written out: no logit mask or processors change them first, and no top_k ranks them."""
    if (not metadata.use_kernels or metadata.output_counts is None or metadata.logit_mask is not None
            or metadata.logits_processors or metadata.top_k is not None):
        return None
    from tokenmill.kernels.penalties import Penalties  # triton only where it runs

    return Penalties(metadata.penalty_rows, metadata.output_counts, metadata.seen_mask, metadata.repetition_penalty,
                     metadata.frequency_penalty, metadata.presence_penalty)


def apply_logits_processors(
    logits: torch.Tensor, metadata: SamplingMetadata
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stages 2-4: everything that changes the distribution before temperature. Also returns the
    per-split maxima of the new logits when the fused penalty pass found them (for min_p), else None."""
    if metadata.logits_processors:
        logits = logits.to(torch.float32, copy=True)
        for row, (processors, output_token_ids) in metadata.logits_processors.items():
            for processor in processors:
                logits[row] = processor(output_token_ids, logits[row])
    if metadata.output_counts is not None and metadata.use_kernels:
        from tokenmill.kernels.penalties import apply_penalties_fused  # triton only where it runs

        return apply_penalties_fused(
            logits, metadata.logit_mask, metadata.penalty_rows, metadata.output_counts, metadata.seen_mask,
            metadata.repetition_penalty, metadata.frequency_penalty, metadata.presence_penalty,
        )
    if metadata.logit_mask is not None:
        logits = logits.float() + metadata.logit_mask
    if metadata.output_counts is not None:
        rows = metadata.penalty_rows
        if logits.device.type == "cpu":
            logits = apply_penalties_to_seen(
                logits, metadata.output_counts, metadata.seen_mask, rows, metadata.repetition_penalty,
                metadata.frequency_penalty, metadata.presence_penalty,
            )
        else:
            logits = apply_penalties(
                logits.float(), metadata.output_counts[rows], metadata.seen_mask[rows], metadata.repetition_penalty,
                metadata.frequency_penalty, metadata.presence_penalty,
            )
    return logits, None


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    seen_mask: torch.Tensor,  # prompt or output tokens (repetition penalises both)
    repetition_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
) -> torch.Tensor:
    return _penalise(logits, output_counts, seen_mask, repetition_penalty.unsqueeze(1),
                     frequency_penalty.unsqueeze(1), presence_penalty.unsqueeze(1))


def _penalise(values: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor | None, repetition: torch.Tensor,
              frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """The penalties' formula: repetition at the seen values (all of them where `seen` is None), then frequency
    and presence by the output counts."""
    repeated = torch.where(values > 0, values / repetition, values * repetition)
    values = repeated if seen is None else torch.where(seen, repeated, values)
    return values - frequency * counts - presence * (counts > 0)


def apply_penalties_to_seen(
    logits: torch.Tensor,
    output_counts: torch.Tensor,  # [state rows, vocab]
    seen_mask: torch.Tensor,  # [state rows, vocab]
    penalty_rows: torch.Tensor,  # [rows]: each logits row's state row
    repetition_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
) -> torch.Tensor:
    """apply_penalties' values (a new float32 tensor) computed at the tokens each row has seen only: a penalty
    changes no other (output tokens are seen tokens). The CPU's way: a few hundred tokens a row instead of seven
    passes over the whole vocabulary (4 ms a step for 16 x 49,152 on one core)."""
    batch_rows, token_ids = seen_mask[penalty_rows].nonzero(as_tuple=True)
    counts = output_counts[penalty_rows[batch_rows], token_ids]
    seen = _penalise(logits[batch_rows, token_ids].float(), counts, None, repetition_penalty[batch_rows],
                     frequency_penalty[batch_rows], presence_penalty[batch_rows])
    logits = logits.to(torch.float32, copy=True)
    logits[batch_rows, token_ids] = seen
    return logits


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row (ties: the lowest token id). On the CPU torch.max's indices are the same and ~3x
    faster than torch.argmax (4.6 against 1.5 ms for 64 x 49,152 float32 on one core). On CUDA the sampler's
    kernel: it spreads a few rows over the whole GPU, where torch's reduction of a row runs in one block (H200: an
    EAGLE-3 head's 32,000-token row 10.7 us)."""
    if logits.device.type == "cpu":
        if argmax_applies(logits):  # one C pass (sample.cpu_argmax)
            return argmax_rows(logits)
        return torch.max(logits, dim=-1).indices
    if logits.device.type == "cuda" and triton_available():
        return kernel_argmax(logits, None)
    return logits.argmax(dim=-1)


def kernel_argmax(logits: torch.Tensor, penalties: Penalties | None) -> torch.Tensor:
    from tokenmill.kernels.sampling import greedy_argmax  # triton only where it runs

    return greedy_argmax(logits, penalties)


def fused_draw(logits: torch.Tensor, metadata: SamplingMetadata, row_maxima: torch.Tensor | None,
               penalties: Penalties | None) -> torch.Tensor:
    """Stages 5-7 in Triton for every row: the candidate floor (top_k, min_p), then the draw. Rows with a
    small top_k are drawn among their few candidates while the floor is found; the others over the
    whole vocabulary. `penalties`: applied by the draw kernels as they load the logits (no top_k then)."""
    # triton imports only where the metadata chose this path
    from tokenmill.kernels.sampling import categorical_draw, split_maxima, top_p_draw
    from tokenmill.kernels.sampling_floor import MAX_FAST_K, CandidateDraw, candidate_floor

    temperature, floor, tokens = metadata.draw_temperature, None, None
    if penalties is not None and metadata.min_p is not None:
        row_maxima = split_maxima(logits, penalties)  # min_p compares with the largest penalised logit
    small_top_k = 0 < metadata.max_top_k <= MAX_FAST_K  # every sampled row is drawn among its candidates
    if metadata.top_k is not None or metadata.min_p is not None:
        draw = None
        if metadata.top_k is not None:
            tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
            draw = CandidateDraw(metadata.top_p, metadata.seeds, tokens, temperature.clone())
        floor = candidate_floor(logits, temperature, metadata.top_k, metadata.min_p, maxima=row_maxima, draw=draw,
                                small_top_k=small_top_k)
        if small_top_k and not metadata.has_greedy_rows:
            return tokens  # every row drawn: no full-vocabulary pass
        if draw is not None:
            temperature = draw.temperature  # -1 in the rows drawn already
    if metadata.top_p is None:
        return categorical_draw(logits, temperature, metadata.seeds, floor=floor, out=tokens, penalties=penalties)
    # categorical_draw, then redraws of the top-p rows whose draw fell outside the nucleus
    return top_p_draw(logits, temperature, metadata.top_p, metadata.seeds, floor=floor, out=tokens,
                      penalties=penalties)


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Stages 6-7 for the non-greedy rows (greedy rows have temperature 1 and are replaced later).

    `logits` may be in the model's dtype: the candidate path takes its top k before any float32 pass
    over the vocabulary (a positive temperature keeps the order).
    """
    if metadata.top_k_candidates:
        return sample_top_k_candidates(logits, metadata)
    logits = logits.float() / metadata.temperature.unsqueeze(1)
    if draw_applies(logits):  # min_p and top_p in the draw (top_p by rejection rounds: no sort)
        if metadata.top_k is not None:
            logits = apply_top_k_top_p(logits, metadata.top_k, None)
        uniforms = row_uniforms(logits.shape[0], metadata.generators, metadata.top_p)
        return draw_rows(logits, uniforms, metadata.top_p, metadata.min_p)
    logits = certain_where_overflowed(logits)
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    if metadata.top_k is not None or metadata.top_p is not None:
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    probs = logits.softmax(dim=-1)
    return (probs / exponential_noise(probs, metadata.generators)).argmax(dim=-1)


def sample_top_k_candidates(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """min_p, top_k and top_p over each row's top-k candidates, then the draw among them.

    Equivalent to the full-vocabulary path: min_p compares with the most likely token, and top_p
    renormalises over the survivors, so neither needs the tokens outside the top k.
    """
    values, token_ids = logits.topk(metadata.top_k_candidates, dim=-1)  # [n, width], descending
    values = values.float() / metadata.temperature.unsqueeze(1)
    positions = torch.arange(values.shape[1], device=values.device)
    values = values.masked_fill(positions[None, :] >= metadata.top_k.unsqueeze(1), float("-inf"))
    if draw_applies(values):
        # In token-id order and with min_p and top_p in the draw, as the whole vocabulary's row is drawn: a seeded
        # row's token does not depend on the path its batch takes.
        token_ids, order = token_ids.sort(dim=-1)
        uniforms = row_uniforms(values.shape[0], metadata.generators, metadata.top_p)
        choice = draw_rows(values.gather(1, order), uniforms, metadata.top_p, metadata.min_p)
        return token_ids.gather(1, choice.unsqueeze(1)).squeeze(1)
    values = certain_where_overflowed(values)
    if metadata.min_p is not None:
        # p / p_max < min_p  <=>  logit < max_logit + log(min_p)
        values = values.masked_fill(values < values[:, :1] + metadata.min_p.log().unsqueeze(1), float("-inf"))
    if metadata.top_p is not None:
        probs = values.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the more likely candidates
        values = values.masked_fill(mass_before >= metadata.top_p.unsqueeze(1), float("-inf"))
    probs = values.softmax(dim=-1)
    noise = exponential_noise(probs, metadata.generators, candidate_ids=token_ids, vocab_size=logits.shape[-1])
    choice = (probs / noise).argmax(dim=-1, keepdim=True)
    return token_ids.gather(1, choice).squeeze(1)


def certain_where_overflowed(logits: torch.Tensor) -> torch.Tensor:
    """Rows with +inf logits (a penalty or the temperature overflowed float32: those tokens are certain) as 0 at
    them and -inf elsewhere, so that torch's draw takes one of them, equally likely, as the C draw does (a
    softmax of inf - inf is NaN, and the argmax of NaN weights token 0); other rows as they are."""
    top = logits.amax(dim=-1, keepdim=True)
    certain = torch.where(logits == top, 0.0, float("-inf")).to(logits.dtype)
    return torch.where(torch.isposinf(top), certain, logits)


def draw_from_probs(probs: torch.Tensor) -> torch.Tensor:
    """A token per row of probs [..., vocab] (unnormalised, >= 0; a row of zeros: token 0), unseeded: on the CPU the
    C draw over their logs, elsewhere argmax of probs / Exp(1) noise (one exponential per entry)."""
    rows = probs.reshape(-1, probs.shape[-1])
    if draw_applies(rows):
        return draw_rows(rows.log(), torch.rand(rows.shape[0], dtype=torch.float64)).view(probs.shape[:-1])
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)


def exponential_noise(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    candidate_ids: torch.Tensor | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Exp(1) noise for probs [n, vocab], or for [n, k] candidates whose token ids are `candidate_ids`.

    A seeded row draws one value per vocabulary token from its generator, and its candidates take the
    values of their token ids: whether the batch sends it down the full or the candidate path, its
    draw is the same, so its tokens do not depend on the batch.
    """
    noise = torch.empty_like(probs).exponential_()
    for row, generator in generators.items():
        if candidate_ids is None:
            noise[row].exponential_(generator=generator)
        else:
            per_token = torch.empty(vocab_size, dtype=probs.dtype, device=probs.device)
            noise[row] = per_token.exponential_(generator=generator)[candidate_ids[row]]
    return noise


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus.

    top-k alone needs no sort: the k-th largest value of each row comes from one topk over the
    largest k in the batch. top-p sorts once and serves top-k from the same sort.
    """
    vocab = logits.shape[-1]
    if top_p is None:
        assert top_k is not None
        # A row without top_k has the vocabulary as its top_k: one topk as wide would sort every row. The width is
        # the largest top_k of the rows that have one, and the others keep their whole row.
        limited = top_k < vocab
        width = int(torch.where(limited, top_k, 0).max())  # one host read, as the topk's width always was
        if width == 0:
            return logits
        largest = logits.topk(width, dim=-1).values
        kth = largest.gather(1, (top_k.clamp(max=width) - 1).clamp(min=0).unsqueeze(1))
        kth = torch.where(limited.unsqueeze(1), kth, float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))  # ties with the k-th are kept
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        # Keep the last top_k entries of the ascending sort (ties with the k-th are kept).
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(0, vocab - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    sampled = logprobs.gather(1, token_ids.unsqueeze(1))  # [num_reqs, 1]
    ranks = (logprobs > sampled).sum(dim=-1) + 1
    if num_top > 0:
        top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
        ids = torch.cat([token_ids.unsqueeze(1), top_ids], dim=1)
        values = torch.cat([sampled, top_logprobs], dim=1)
    else:
        ids, values = token_ids.unsqueeze(1), sampled
    return LogprobsTensors(ids, values, ranks)
