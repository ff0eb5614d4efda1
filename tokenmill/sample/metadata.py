"""SamplingMetadata: the sampled rows' parameters as batched tensors, None where no row needs a stage.

Every stage the sampler can skip is None when no request in the batch uses it, so the common
case (greedy or plain temperature sampling) pays for nothing else. Per-request parameters live in
numpy columns (`SamplingColumns`), so a step's metadata is a few array gathers and one copy to the
device, not a Python loop over the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from tokenmill.device_copy import pack_to_device
from tokenmill.kernels import triton_available
from tokenmill.sampling_params import SamplingParams

# Candidates kept when top-k is set: top-k (and top-p, min-p) then work on a [num_reqs, k] slice
# instead of sorting the whole vocabulary. Larger k falls back to the full sort.
MAX_TOP_K_CANDIDATES = 1024


@dataclass
class SamplingColumns:
    """One entry per request: the numeric sampling parameters, in numpy."""

    temperature: np.ndarray  # float32; 1.0 for greedy rows (their draw is discarded)
    is_greedy: np.ndarray  # bool
    top_k: np.ndarray  # int64; vocab size where disabled
    top_p: np.ndarray  # float32
    min_p: np.ndarray  # float32
    presence_penalty: np.ndarray  # float32
    frequency_penalty: np.ndarray  # float32
    repetition_penalty: np.ndarray  # float32
    has_penalties: np.ndarray  # bool
    logprobs: np.ndarray  # int64; -1 = none

    @classmethod
    def empty(cls, num_rows: int) -> SamplingColumns:
        return cls(
            temperature=np.ones(num_rows, np.float32), is_greedy=np.ones(num_rows, bool),
            top_k=np.zeros(num_rows, np.int64), top_p=np.ones(num_rows, np.float32),
            min_p=np.zeros(num_rows, np.float32), presence_penalty=np.zeros(num_rows, np.float32),
            frequency_penalty=np.zeros(num_rows, np.float32), repetition_penalty=np.ones(num_rows, np.float32),
            has_penalties=np.zeros(num_rows, bool), logprobs=np.full(num_rows, -1, np.int64),
        )

    @classmethod
    def from_params(cls, params: list[SamplingParams], vocab_size: int) -> SamplingColumns:
        columns = cls.empty(len(params))
        for row, p in enumerate(params):
            columns.set_row(row, p, vocab_size)
        return columns

    def set_row(self, row: int, p: SamplingParams, vocab_size: int) -> None:
        self.is_greedy[row] = p.is_greedy
        self.temperature[row] = 1.0 if p.is_greedy else p.temperature
        self.top_k[row] = p.top_k if 0 < p.top_k < vocab_size else vocab_size
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.presence_penalty[row] = p.presence_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.repetition_penalty[row] = p.repetition_penalty
        self.has_penalties[row] = p.has_penalties
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs

    def take(self, rows: np.ndarray) -> SamplingColumns:
        return SamplingColumns(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})


@dataclass
class SamplingMetadata:
    all_greedy: bool
    use_kernels: bool
    """Triton kernels (kernels/) apply the penalties and draw every sampled row; else torch does."""
    temperature: torch.Tensor | None  # [num_reqs] float32; 1.0 in greedy rows (the torch draw's input)
    top_k: torch.Tensor | None  # [num_reqs] int64; vocab size where disabled
    max_top_k: int
    """The largest top_k of the sampled rows when every sampled row has one (< vocab size); else 0."""
    has_greedy_rows: bool
    top_k_candidates: int
    """Torch draw only: when every sampled row uses a top_k of at most MAX_TOP_K_CANDIDATES, the largest
    of them: sampling then works on that many candidates per row. 0: the full-vocabulary path."""
    top_p: torch.Tensor | None  # [num_reqs] float32
    min_p: torch.Tensor | None  # [num_reqs] float32
    is_greedy: torch.Tensor | None  # [num_reqs] bool; None unless the torch draw serves greedy and sampled rows
    generators: dict[int, torch.Generator]
    """Row -> the request's own generator, for seeded requests (the torch draw)."""
    seeds: torch.Tensor | None
    """[num_reqs] int64 Philox seeds of the fused Triton draw (kernels/sampling.py), which serves every
    row when it runs; None: the torch draw serves all."""
    draw_temperature: torch.Tensor | None  # [num_reqs] float32, 0 in greedy rows: the fused draw's input
    logit_mask: torch.Tensor | None
    """[num_reqs, vocab] float32 added to the logits: logit_bias, -inf outside allowed_token_ids,
    on bad words and, before min_tokens, on EOS and stop tokens."""
    presence_penalty: torch.Tensor | None  # [num_reqs] float32
    frequency_penalty: torch.Tensor | None  # [num_reqs] float32
    repetition_penalty: torch.Tensor | None  # [num_reqs] float32
    output_counts: torch.Tensor | None  # [max_num_reqs, vocab] int32 occurrences in each state row's output
    seen_mask: torch.Tensor | None  # [max_num_reqs, vocab] bool tokens in each state row's prompt or output
    penalty_rows: torch.Tensor | None  # [num_reqs] int64: each row's state row in the two tensors above
    max_num_logprobs: int | None
    """Largest `logprobs` among the rows; None when no row wants logprobs."""
    logits_processors: dict[int, tuple[list, list[int]]]
    """Row -> (the request's processors, its output token ids); the slow path."""
    banning_rows: np.ndarray | None = None
    """The rows whose logit mask bans tokens (-inf), which alone or with a grammar may leave none."""


def build_sampling_metadata(
    columns: SamplingColumns | list[SamplingParams],
    generators: dict[int, torch.Generator],
    vocab_size: int,
    device: torch.device,
    logit_mask: torch.Tensor | None = None,
    penalty_tensors: tuple[torch.Tensor, torch.Tensor, np.ndarray] | None = None,
    logits_processors: dict[int, tuple[list, list[int]]] | None = None,
    row_seeds: dict[int, int] | None = None,
    use_kernel: bool | None = None,
) -> SamplingMetadata:
    """`penalty_tensors`: (output counts, seen mask (prompt or output tokens; every counted
    token is seen), the batch rows' state rows in them).
    `row_seeds`: row -> this step's seed of a seeded request (the fused draw's key for that row).
    `use_kernel`: whether the Triton kernels may run; None = on CUDA where triton imports."""
    if isinstance(columns, list):
        columns = SamplingColumns.from_params(columns, vocab_size)
    c = columns
    all_greedy = bool(c.is_greedy.all())
    sampled = ~c.is_greedy
    uses_top_k = bool((sampled & (c.top_k < vocab_size)).any())
    uses_top_p = bool((sampled & (c.top_p < 1.0)).any())
    uses_min_p = bool((sampled & (c.min_p > 0.0)).any())
    if use_kernel is None:
        use_kernel = device.type == "cuda" and triton_available()
    fused = use_kernel and not all_greedy
    has_penalties = penalty_tensors is not None
    mixed = c.is_greedy.any() and not all_greedy and not fused
    host: dict[str, np.ndarray] = {}  # every host column the step needs, copied to the device together
    num_rows = len(c.is_greedy)
    if not all_greedy or has_penalties:
        # One part per column: pack_to_device starts every part 16-byte aligned whatever the batch size (Triton
        # specialises kernels on pointer alignment; a batch-dependent one would compile variants mid-run).
        host.update(temperature=c.temperature, top_p=c.top_p, min_p=c.min_p, presence=c.presence_penalty,
                    frequency=c.frequency_penalty, repetition=c.repetition_penalty,
                    draw_temperature=np.where(c.is_greedy, np.float32(0.0), c.temperature))
    if uses_top_k:
        host["top_k"] = c.top_k
    if mixed:
        host["is_greedy"] = c.is_greedy
    if fused and row_seeds:
        host.update(seeded_rows=np.fromiter(row_seeds, np.int64), seeded_keys=np.fromiter(row_seeds.values(), np.int64))
    if has_penalties:
        host["penalty_rows"] = penalty_tensors[2].astype(np.int64)
    on_device = dict(zip(host, pack_to_device(list(host.values()), device)[2])) if host else {}
    temperature, top_p, min_p, presence, frequency, repetition, draw_temperature = (
        on_device.get(name) for name in ("temperature", "top_p", "min_p", "presence", "frequency", "repetition",
                                         "draw_temperature"))
    seeds = _draw_keys(num_rows, device) if fused else None
    if seeds is not None and row_seeds:
        seeds[on_device["seeded_rows"]] = on_device["seeded_keys"]
    wanted = c.logprobs[c.logprobs >= 0]
    return SamplingMetadata(
        all_greedy=all_greedy,
        use_kernels=use_kernel,
        temperature=None if all_greedy else temperature,
        top_k=on_device.get("top_k"),
        max_top_k=_max_top_k(c, sampled, vocab_size),
        has_greedy_rows=bool(c.is_greedy.any()),
        top_k_candidates=0 if fused else _candidate_width(c, sampled, vocab_size),
        top_p=top_p if uses_top_p else None,
        min_p=min_p if uses_min_p else None,
        is_greedy=on_device.get("is_greedy"),
        generators=generators,
        seeds=seeds,
        draw_temperature=draw_temperature if fused else None,
        logit_mask=logit_mask,
        presence_penalty=presence if has_penalties else None,
        frequency_penalty=frequency if has_penalties else None,
        repetition_penalty=repetition if has_penalties else None,
        output_counts=penalty_tensors[0] if has_penalties else None,
        seen_mask=penalty_tensors[1] if has_penalties else None,
        penalty_rows=on_device.get("penalty_rows"),
        max_num_logprobs=int(wanted.max()) if len(wanted) else None,
        logits_processors=logits_processors or {},
    )


def with_fresh_seeds(metadata: SamplingMetadata) -> SamplingMetadata:
    """The same batch's metadata for the next step: only the fused draw's keys change. For batches without
    seeded rows (their keys follow their position, so they come from a fresh build)."""
    if metadata.seeds is None:
        return metadata
    return replace(metadata, seeds=_draw_keys(len(metadata.seeds), metadata.seeds.device))


def _max_top_k(c: SamplingColumns, rows: np.ndarray, vocab_size: int) -> int:
    if not rows.any() or (c.top_k[rows] >= vocab_size).any():
        return 0  # some row needs the whole vocabulary
    return int(c.top_k[rows].max())


def _candidate_width(c: SamplingColumns, rows: np.ndarray, vocab_size: int) -> int:
    """`rows`: the rows whose draw the torch path must get right."""
    width = _max_top_k(c, rows, vocab_size)
    return width if width <= MAX_TOP_K_CANDIDATES else 0


def _draw_keys(num_rows: int, device: torch.device) -> torch.Tensor:
    # Fresh Philox keys drawn where they are used (no host copy), from torch's generator of that device,
    # so torch.manual_seed repeats a run.
    return torch.randint(0, 2**63 - 1, (num_rows,), dtype=torch.int64, device=device)
