"""Per-request sampling state kept on the worker between steps.

Penalty inputs are kept incrementally on the device: each row's output-token counts and the set
of tokens it has seen (prompt or output: the tokens repetition penalises, and the only ones whose
counts the penalty kernel reads), allocated the first time a request with penalties arrives and
updated with two scatters per step. Numeric parameters sit in numpy columns filled when a request arrives; only
rows with per-request work (seeds, bad words, logits processors, pending min_tokens, allowed ids,
logit bias) are visited in Python each step. A batch of the same rows as the last step (steady decoding),
none of them visited in Python, reuses the last step's device metadata with fresh draw keys.
"""

from __future__ import annotations

import functools
import inspect

import numpy as np
import torch

from tokenmill.sample.metadata import SamplingColumns, SamplingMetadata, build_sampling_metadata, with_fresh_seeds
from tokenmill.sample.thinking_budget import ThinkingBudgets
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.request_state import RequestStates


class SamplingState:
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids: list[frozenset[int]] = [frozenset()] * max_num_reqs
        self.columns = SamplingColumns.empty(max_num_reqs)
        self.needs_host_pass = np.zeros(max_num_reqs, dtype=bool)
        self.needs_output_ids = np.zeros(max_num_reqs, dtype=bool)
        """Rows whose sampling reads their output token ids on the host (bad words, logits processors)."""
        self.output_counts: torch.Tensor | None = None  # [max_num_reqs, vocab] int32
        self.seen_mask: torch.Tensor | None = None  # [max_num_reqs, vocab] bool: in the prompt or the output
        self._seeded_generators: dict[int, torch.Generator] = {}
        self._fixed_masks: dict[int, torch.Tensor] = {}
        """Row -> its logit mask from allowed_token_ids and logit_bias ([vocab] float32, on the host): the same every
        step, so built once when the request arrives (from a list of up to the vocabulary's ids) and copied after.
        Replaced when the row is reused: at most max_num_reqs of them."""
        self._last: tuple[bytes, SamplingMetadata] | None = None
        """The last reusable batch's rows (as bytes) and metadata; None after any row changed."""
        self.thinking = ThinkingBudgets(max_num_reqs, device)
        """The rows' thinking_token_budget machines (device state: the host reads no tokens for them)."""

    def add_request(self, row: int, params: SamplingParams, eos_token_ids: frozenset[int],
                    token_ids: list[int], num_prompt_tokens: int) -> None:
        self.eos_token_ids[row] = eos_token_ids
        self._last = None
        self.columns.set_row(row, params, self.vocab_size)
        self.thinking.add(row, params.thinking_token_budget, params.thinking_start_token_ids,
                          params.thinking_end_token_ids, token_ids, num_prompt_tokens)
        self.needs_host_pass[row] = bool(
            (params.seed is not None and not params.is_greedy) or params.bad_words_token_ids
            or params.logits_processors or params.min_tokens or params.allowed_token_ids is not None
            or params.logit_bias
        )
        # Grammars are not here: the model runner masks their rows (structured/matchers.py) and waits for their
        # tokens itself, and their metadata is a plain row's (so an unchanged batch reuses it).
        self.needs_output_ids[row] = bool(params.bad_words_token_ids or params.logits_processors)
        self._fixed_masks.pop(row, None)
        if params.allowed_token_ids is not None or params.logit_bias:
            self._fixed_masks[row] = self._fixed_mask(params)
        if not params.has_penalties:
            return
        if self.output_counts is None:
            self.output_counts = torch.zeros(self.max_num_reqs, self.vocab_size, dtype=torch.int32,
                                             device=self.device)
            self.seen_mask = torch.zeros(self.max_num_reqs, self.vocab_size, dtype=torch.bool, device=self.device)
        # Built on the host, then copied without blocking: a blocking copy would wait for the GPU.
        seen = torch.tensor(token_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        output = seen[num_prompt_tokens:]
        self.seen_mask[row].zero_()
        self.seen_mask[row, seen] = True
        self.output_counts[row].zero_()
        self.output_counts[row].index_add_(0, output, torch.ones_like(output, dtype=torch.int32))

    def record_sampled(self, rows: np.ndarray, token_ids: torch.Tensor, rows_on_device: torch.Tensor | None) -> None:
        """Count the new tokens (rows without penalties are counted too; nobody reads them), and move the thinking
        budgets' machines. `rows_on_device`: `rows` already copied to the device (the metadata's penalty_rows), if
        any."""
        self.thinking.advance(rows, token_ids)
        if self.output_counts is not None:
            index = rows_on_device
            if index is None:
                index = torch.from_numpy(rows).to(self.device, non_blocking=True)
            self.output_counts.index_put_((index, token_ids), torch.ones_like(token_ids, dtype=torch.int32),
                                          accumulate=True)
            # A device value: a Python True would be copied from the host, which waits for the GPU.
            self.seen_mask.index_put_((index, token_ids), torch.ones_like(token_ids, dtype=torch.bool))

    def build_metadata(self, rows: np.ndarray, states: RequestStates) -> SamplingMetadata:
        key = None if self.needs_host_pass[rows].any() else rows.tobytes()
        if key is not None and self._last is not None and self._last[0] == key:
            return with_fresh_seeds(self._last[1])
        metadata = self._build_metadata(rows, states)
        self._last = None if key is None else (key, metadata)
        return metadata

    def _build_metadata(self, rows: np.ndarray, states: RequestStates) -> SamplingMetadata:
        masked: dict[int, tuple[int, list[int]]] = {}
        processors: dict[int, tuple[list, list[int]]] = {}
        generators: dict[int, torch.Generator] = {}
        row_seeds: dict[int, int] = {}
        for i in np.flatnonzero(self.needs_host_pass[rows]).tolist():
            row = int(rows[i])
            p = states.sampling_params[row]
            num_output = int(states.num_tokens[row] - states.num_prompt_tokens[row])
            if p.seed is not None and not p.is_greedy:
                # Reseeded from (seed, position) every step: the draw depends on nothing else, so batch
                # composition and preemption cannot change a seeded request's tokens.
                row_seeds[i] = hash((p.seed, num_output)) & ((1 << 63) - 1)
                generators[i] = self._seeded_generator(i, row_seeds[i])
            output_ids = states.output_token_ids(row) if self.needs_output_ids[row] else []
            banned = self._banned_tokens(p, row, num_output, output_ids)
            if banned or row in self._fixed_masks:
                masked[i] = (row, banned)
            if p.logits_processors:
                processors[i] = (_with_prompt(p.logits_processors, states, row), output_ids)
        columns = self.columns.take(rows)
        penalties = None
        if self.output_counts is not None and columns.has_penalties.any():
            penalties = (self.output_counts, self.seen_mask, rows)
        metadata = build_sampling_metadata(
            columns, generators, self.vocab_size, self.device,
            logit_mask=self._make_mask(len(rows), masked), penalty_tensors=penalties,
            logits_processors=processors, row_seeds=row_seeds,
        )
        banning = [i for i, (row, banned) in masked.items()
                   if banned or states.sampling_params[row].bans_tokens]
        metadata.banning_rows = np.array(banning, dtype=np.int64) if banning else None
        return metadata

    def _seeded_generator(self, index: int, step_seed: int) -> torch.Generator:
        generator = self._seeded_generators.setdefault(index, torch.Generator(self.device))
        generator.manual_seed(step_seed)
        return generator

    def _banned_tokens(self, p: SamplingParams, row: int, num_output: int, output_ids: list[int]) -> list[int]:
        banned = []
        for word in p.bad_words_token_ids:
            # A word's last token is banned once the output ends with the rest of the word.
            if len(word) == 1 or output_ids[len(output_ids) - len(word) + 1 :] == word[:-1]:
                banned.append(word[-1])
        if num_output < p.min_tokens:
            banned += p.stop_token_ids
            if not p.ignore_eos:
                banned += self.eos_token_ids[row]
        return banned

    def _make_mask(self, num_rows: int, masked: dict[int, tuple[int, list[int]]]) -> torch.Tensor | None:
        """masked: batch index -> (its row, the tokens it may not sample this step)."""
        if not masked:
            return None
        mask = torch.zeros(num_rows, self.vocab_size, dtype=torch.float32)
        for i, (row, banned) in masked.items():
            fixed = self._fixed_masks.get(row)
            if fixed is not None:
                mask[i] = fixed
            if banned:
                mask[i, banned] = float("-inf")
        return mask.to(self.device, non_blocking=True)

    def _fixed_mask(self, p: SamplingParams) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.float32)
        if p.allowed_token_ids is not None:
            mask.fill_(float("-inf"))
            mask[p.allowed_token_ids] = 0.0
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64)
            mask.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=torch.float32))
        return mask


def _with_prompt(processors: list, states: RequestStates, row: int) -> list:
    """vLLM's two forms of processor: fn(output_ids, logits), or fn(prompt_ids, output_ids, logits), which gets the
    prompt bound here (the sampler calls every one with the output ids and the logits)."""
    takes_prompt = [_num_required_args(f) == 3 for f in processors]
    if not any(takes_prompt):
        return processors
    prompt_ids = states.token_ids[row, : states.num_prompt_tokens[row]].tolist()
    return [functools.partial(f, prompt_ids) if t else f for f, t in zip(processors, takes_prompt)]


def _num_required_args(f) -> int | None:
    """Positional parameters without a default (fn(ids, logits, scale=2.0) is of the two-argument form)."""
    try:
        parameters = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):  # no signature to read (some builtins): the two-argument form, as before
        return None
    return sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)
