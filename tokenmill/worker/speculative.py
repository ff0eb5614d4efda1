"""Speculative decoding's part of a step on the worker: drafting into the lookahead, and verification.

Before the forward pass, the proposer writes up to the scheduled lookahead of draft tokens after each
request's known tokens (in its row of RequestStates). After it, the sampler draws at each request's
last position as in plain decoding, and spec/rejection.py decides how many drafts before it stand. With a
draft tree (speculative_token_tree) the drafts are the tree's first nodes, and worker/tree_verify.py verifies
them (a grammar masks every node's logits row: structured/matcher_set.py); the drafter then observes the
step's hidden states after the verification, in the accepted order.

A chain the proposer drafted right after the last verification (spec/eagle.py draft_after_verify) stays where it
was made: the next step writes it into its input ids on the device and the verification reads every draft from
those, so that step is laid out and launched while the device still drafts, without waiting for the drafts on the
host (a row with a grammar still waits: its masks need them there).
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.device_copy import pack_to_device, to_device
from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    gather_logprobs,
    greedy_ids,
    raw_scores,
)
from tokenmill.sample.state import SamplingState
from tokenmill.scheduler.output import SchedulerOutput
from tokenmill.spec.proposers import Proposer
from tokenmill.spec.rejection import VerifyBatch, plain_greedy, verify_drafts
from tokenmill.worker.input_batch import InputBatch
from tokenmill.worker.pending_output import VerifiedTokens
from tokenmill.worker.request_state import RequestStates
from tokenmill.worker.tree_verify import TreeVerification
from tokenmill.worker.verify_ahead import VerifyAhead


class SpeculativeDecoding:
    def __init__(self, proposer: Proposer, sampler: Sampler, device: torch.device,
                 tree: TreeVerification | None = None, places_on_device: bool = False) -> None:
        """`places_on_device`: the attention backend moves decode positions on the device (verify_ahead)."""
        self.proposer = proposer
        self.sampler = sampler
        self.device = device
        self.tree = tree
        """Draft trees' verification; None: chains."""
        self._tree_step_states: tuple[InputBatch, torch.Tensor] | None = None
        """A tree step's batch and hidden states, observed once its verification has ordered them."""
        self.drafts_after_verify = tree is None and hasattr(proposer, "draft_after_verify")
        """Whether the proposer drafts each verifying row's next chain right after the verification (spec/eagle.py)."""
        self._verify_states: torch.Tensor | None = None
        """This step's target states, for draft_after_verify."""
        self._draft_inputs: tuple | None = None
        """The last verification's rows and what draft_after_verify drafts their next chain from."""
        self._drafts_to_place: tuple | None = None
        """This step's drafts read where draft_after_verify made them: (batch indices, their rows in the drafts,
        counts, drafts [m, k] on the device), for place_drafts."""
        self._input_ids: torch.Tensor | None = None
        """This step's input ids on the device, where the verification reads each draft."""
        self.launches_ahead = self.drafts_after_verify and places_on_device
        """Whether a step may launch before the last one's tokens are on the host (worker/verify_ahead.py)."""
        self._ahead: tuple[VerifyAhead, torch.Tensor] | None = None
        """This step's VerifyAhead and each request's rejected drafts of the last step (on the device)."""
        self._drop = getattr(proposer, "drop", None)
        """The proposer's drop(rows) of its state per request (the n-gram index), if it keeps any."""

    def drop_finished(self, request_ids: set[str], states: RequestStates) -> None:
        """Requests finished or preempted (before their rows are freed): the proposer's state for them goes."""
        if self._drop is not None and request_ids:
            self._drop([states.row_of[rid] for rid in request_ids if rid in states.row_of])

    def propose(self, scheduler_output: SchedulerOutput, states: RequestStates) -> np.ndarray:
        """Draft tokens for the requests given lookahead, written after their known tokens; returns the
        number of drafts of each request of the step, in batch order."""
        self._ahead = None
        request_ids = list(scheduler_output.num_scheduled_tokens)
        num_drafts = np.zeros(len(request_ids), dtype=np.int64)
        index = {rid: i for i, rid in enumerate(request_ids)}
        candidates = [(index[rid], states.row_of[rid], k) for rid, k in scheduler_output.num_lookahead_tokens.items()]
        # Before min_tokens the EOS ban depends on the position: those requests decode one token per step.
        num_output = states.num_tokens - states.num_prompt_tokens
        params = states.sampling_params
        candidates = [(i, row, k) for i, row, k in candidates if num_output[row] >= params[row].min_tokens]
        if not candidates:
            return num_drafts
        positions, rows, max_drafts = (np.array(column, dtype=np.int64) for column in zip(*candidates))
        if self.drafts_after_verify:
            on_device = self._drafts_on_device(states, positions, rows, max_drafts, num_drafts)
            if on_device.all():
                return num_drafts
            positions, rows, max_drafts = positions[~on_device], rows[~on_device], max_drafts[~on_device]
        lengths = states.num_tokens[rows]
        drafts = self.proposer.propose(states, rows, max_drafts)
        for i, row, length, draft in zip(positions.tolist(), rows.tolist(), lengths.tolist(), drafts):
            states.token_ids[row, length : length + len(draft)] = draft
            num_drafts[i] = len(draft)
        return num_drafts

    def take_drafts_ahead(self, ahead: VerifyAhead) -> np.ndarray:
        """A step launched ahead (worker/verify_ahead.py) verifies the drafts its rows' last step made, on the
        device: returns each request's count."""
        num_reqs = len(ahead.index)
        self._drafts_to_place = (np.arange(num_reqs), ahead.drafts_index, ahead.num_drafts, ahead.last.next_drafts[1])
        self._ahead = (ahead, ahead.rejected())
        return ahead.num_drafts.copy()

    def ahead_shift(self, batch: InputBatch) -> tuple[np.ndarray, torch.Tensor]:
        """For a step launched ahead (take_drafts_ahead): each token's request [num_tokens] and the requests'
        rejected drafts of the last step on the device, by which the positions move back."""
        return np.repeat(np.arange(len(batch.rows)), batch.num_new), self._ahead[1]

    def _drafts_on_device(self, states: RequestStates, batch_index: np.ndarray, rows: np.ndarray,
                          max_drafts: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
        """The rows whose drafts draft_after_verify made in the last step and that need them nowhere but in the
        forward pass and the verification: both read them on the device (place_drafts), so that this step
        launches while the device still drafts them. Their counts go into num_drafts; returns which rows."""
        found = states.next_drafts_on_device(rows)
        if found is None:
            return np.zeros(len(rows), dtype=bool)
        ready, index, drafts = found
        # A grammar reads its row's drafts on the host (structured/).
        ready &= np.fromiter((states.sampling_params[row].structured_outputs is None for row in rows.tolist()),
                             dtype=bool, count=len(rows))
        if ready.any():
            self.proposer.settle(states, rows[ready])
            counts = np.minimum(max_drafts[ready], drafts.shape[1])
            num_drafts[batch_index[ready]] = counts
            self._drafts_to_place = (batch_index[ready], index[ready], counts, drafts)
        return ready

    def draft_places(self, batch: InputBatch) -> np.ndarray | None:
        """[2, m]: where the drafts that propose left on the device go in the step's input ids (each row's last
        tokens), and where each is in those drafts (flat); None when there are none."""
        if self._drafts_to_place is None:
            return None
        batch_index, index, counts, drafts = self._drafts_to_place
        within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        dst = np.repeat(batch.query_start_loc[1:][batch_index] - counts, counts) + within
        return np.stack([dst, np.repeat(index * drafts.shape[1], counts) + within])

    def place_drafts(self, input_ids: torch.Tensor, places: torch.Tensor | None) -> None:
        """The step's input ids on the device [num_tokens]: the drafts are written in at `places` (draft_places' on
        the device), and the verification reads every draft there."""
        self._input_ids = input_ids
        if places is not None:
            drafts = self._drafts_to_place[3]
            input_ids[places[0]] = drafts.reshape(-1)[places[1]]
        self._drafts_to_place = None

    def observe(self, batch: InputBatch, states: RequestStates, hidden_states: torch.Tensor,
                aux_hidden_states: torch.Tensor | None = None) -> None:
        """The target's hidden states of the step, for proposers that draft from them: its auxiliary
        layers' where the model returns them (EAGLE-3), else its last (EAGLE)."""
        observe = getattr(self.proposer, "observe", None)
        if observe is None:
            return
        hidden_states = hidden_states if aux_hidden_states is None else aux_hidden_states
        if batch.buffer_positions is not None:  # a tree step: which nodes stand is known after sampling
            self._tree_step_states = (batch, hidden_states[: batch.num_tokens])
            return
        self._verify_states = None
        if self.drafts_after_verify and batch.sampled_num_drafts.any():
            # The verifying rows' states go to draft_after_verify once the verification has decided what stands.
            self._verify_states = hidden_states
            if batch.sampled_num_drafts.all() and np.array_equal(batch.rows, batch.sampled_rows):
                return  # every row verifies (np.isin below costs ~50 us a step, a tenth of a batch-1 step's host time)
            skip = np.isin(batch.rows, batch.sampled_rows[batch.sampled_num_drafts > 0])
            if not skip.all():
                observe(states, batch.rows, batch.query_start_loc, batch.positions, hidden_states, skip=skip)
            return
        observe(states, batch.rows, batch.query_start_loc, batch.positions, hidden_states)

    def sample_and_verify(
        self, logits: torch.Tensor, batch: InputBatch, metadata: SamplingMetadata, states: RequestStates,
        sampling_state: SamplingState,
    ) -> tuple[VerifiedTokens, SamplerOutput]:
        """The sampler draws at each request's last position, as in plain decoding; the draft positions
        before it are verified against the target (spec/rejection.py), which decides what is emitted."""
        if self.tree is not None:
            verified, output, order = self.tree.sample_and_verify(logits, batch, metadata, states, sampling_state)
            if self._tree_step_states is not None:
                step, hidden_states = self._tree_step_states
                self._tree_step_states = None
                self.proposer.observe(states, step.rows, step.query_start_loc, step.buffer_positions,
                                      hidden_states[order])
            return verified, output
        counts = 1 + batch.sampled_num_drafts
        starts = np.cumsum(counts) - counts
        verifying = np.flatnonzero(batch.sampled_num_drafts)
        max_drafts = int(batch.sampled_num_drafts.max())
        offsets = np.minimum(np.arange(max_drafts)[None, :], batch.sampled_num_drafts[verifying, None] - 1)
        logit_positions = starts[verifying, None] + offsets
        draft_rows = batch.sampled_rows[verifying]
        first_draft = states.num_tokens[draft_rows]
        rejected = None
        if self._ahead is not None:  # laid out as if the last step's drafts all stood: moved back by `shift` below
            (ahead, rejected), self._ahead = self._ahead, None
            first_draft = first_draft + ahead.num_ahead[verifying]
        # Draft j of a row is the input token after the one whose logits verify it (place_drafts).
        draft_index = batch.logits_indices[logit_positions + 1]
        is_greedy = sampling_state.columns.is_greedy[draft_rows]
        # One host-to-device copy for everything the verification indexes with.
        host = [starts + counts - 1, verifying, draft_index, batch.sampled_num_drafts[verifying], logit_positions,
                is_greedy]
        last_t, rows_t, draft_index_t, num_drafts_t, positions_t, greedy_t = pack_to_device(host, self.device)[2]
        draft_ids_t = self._input_ids[draft_index_t]
        shift = None if rejected is None else rejected[rows_t]
        position_argmax = None
        if plain_greedy(metadata):  # every position's argmax in one pass: the sampler's tokens and the verdicts'
            position_argmax = greedy_ids(logits)
            output = SamplerOutput(position_argmax[last_t])
        else:
            output = self.sampler(logits[last_t], metadata)
        verify = VerifyBatch(rows_t, draft_ids_t, num_drafts_t, positions_t, greedy_t, bool(is_greedy.all()))
        verified, num_verified = verify_drafts(logits, output.token_ids[rows_t], verify, metadata, position_argmax)
        if len(verifying) == len(counts):  # every row verified (in batch order): their tokens are the step's
            tokens, num_emitted = verified, num_verified
        else:
            tokens = torch.full((len(counts), 1 + max_drafts), -1, dtype=torch.int64, device=logits.device)
            tokens[:, 0] = output.token_ids
            tokens[rows_t] = verified
            num_emitted = torch.ones(len(counts), dtype=torch.int64, device=logits.device)
            num_emitted[rows_t] = num_verified
        if metadata.max_num_logprobs is not None:
            output.logprobs = self._verified_logprobs(logits, tokens, counts, starts, metadata.max_num_logprobs)
        if self._verify_states is not None:  # what draft_next needs, before the launch counts this step's tokens
            num_v = batch.sampled_num_drafts[verifying]
            positions = np.repeat(starts[verifying], 1 + num_v) + np.arange(int((1 + num_v).sum())) - np.repeat(
                np.cumsum(1 + num_v) - 1 - num_v, 1 + num_v)
            target_states = self._verify_states[to_device(batch.logits_indices[positions], self.device)]
            self._verify_states = None
            inputs = (draft_rows, first_draft - 1, num_v, target_states, verified, num_verified, shift)
            self._draft_inputs = (verifying, inputs)
        return VerifiedTokens(tokens, num_emitted, batch.sampled_num_drafts, starts), output

    def draft_next(self, states: RequestStates) -> tuple[np.ndarray, torch.Tensor] | None:
        """The next step's drafts of the rows the last sample_and_verify verified, drafted at once on the device
        (proposer.draft_after_verify) once that step's tokens are on their way to the host: the rows' indices in
        the step's sampled rows and their drafts [n, k]; None when the proposer does not draft so."""
        if self._draft_inputs is None:
            return None
        (indices, inputs), self._draft_inputs = self._draft_inputs, None
        return indices, self.proposer.draft_after_verify(states, *inputs)

    def _verified_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, counts: np.ndarray, starts: np.ndarray,
                           num_top: int) -> LogprobsTensors:
        """Raw logprobs at every verified position, of the token emitted there (the positions past a
        rejection carry a placeholder; nobody reads them)."""
        row_of_position = np.repeat(np.arange(len(counts)), counts)
        column = np.arange(counts.sum()) - np.repeat(starts, counts)
        index = to_device(np.stack([row_of_position, column]), self.device)
        emitted = tokens[index[0], index[1]].clamp(min=0)
        return gather_logprobs(raw_scores(logits, self.sampler.logprobs_mode), emitted, num_top)
