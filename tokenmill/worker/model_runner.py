"""ModelRunner: one scheduled step -> forward pass -> sampled tokens.

This file must only contain the path common to every model and request: update the persistent
request rows, draft tokens where the step gives lookahead, build inputs, run the model under the
step's forward context, sample (and verify the drafts). Rarer features belong in their own modules
behind these calls.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.device_copy import pack_to_device, to_device
from tokenmill.distributed.parallel_state import get_pp_stage
from tokenmill.forward_context import forward_context
from tokenmill.layers.rotary import long_prompt_flags
from tokenmill.sample.logprobs import PromptLogprobsCollector
from tokenmill.sample.no_token import emitted_from_nothing, rows_without_token
from tokenmill.sample.sampler import Sampler
from tokenmill.sample.state import SamplingState
from tokenmill.scheduler.output import ModelRunnerOutput, SchedulerOutput
from tokenmill.spec.proposers import Proposer
from tokenmill.spec.tree import TokenTree
from tokenmill.structured.matchers import GrammarRows
from tokenmill.worker.cuda_graph import CudaGraphRunner
from tokenmill.worker.input_batch import InputBatch, prepare_inputs
from tokenmill.worker.mixed_cuda_graph import MixedCudaGraphRunner
from tokenmill.worker.pending_output import DeferredSample, PendingOutput, ReadyOutput, VerifiedTokens
from tokenmill.worker.request_state import RequestStates
from tokenmill.worker.speculative import SpeculativeDecoding
from tokenmill.worker.stage_tokens import receive_sampled_tokens, share_sampled_tokens
from tokenmill.worker.tree_verify import TreeVerification
from tokenmill.worker.verify_ahead import VerifyAhead, verify_ahead

EMPTY_OUTPUT = ReadyOutput(ModelRunnerOutput(sampled_token_ids={}))


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        attn_backend: AttentionBackend,
        device: torch.device,
        block_size: int,
        max_num_reqs: int,
        max_model_len: int,
        vocab_size: int,
        proposer: Proposer | None = None,
        max_drafts: int = 0,
        num_batches_in_flight: int = 1,
        tree: TokenTree | None = None,
        logprobs_mode: str = "raw_logprobs",
    ) -> None:
        """`max_drafts`: draft positions per request (a tree's depth); `tree`: the draft tree, None for chains;
        `logprobs_mode`: ModelConfig.logprobs_mode."""
        self.model = model
        self.attn_backend = attn_backend
        self.device = device
        self.block_size = block_size
        max_blocks_per_req = -(-max_model_len // block_size)
        self.states = RequestStates(max_num_reqs, max_model_len, max_blocks_per_req)
        self.sampler = Sampler(logprobs_mode)
        self.sampling_state = SamplingState(max_num_reqs, vocab_size, device)
        self.prompt_logprobs = PromptLogprobsCollector()
        self.cuda_graphs: CudaGraphRunner | None = None
        """Decode graphs, set by the worker after the KV pool exists (None: always eager)."""
        self.mixed_cuda_graphs: MixedCudaGraphRunner | None = None
        """Graphs for steps with prefills up to a size, set by the worker as well (None: those run eagerly)."""
        self.grammar_rows: GrammarRows | None = None
        """Structured outputs' per-row grammars; set by the worker when the engine enables them."""
        self.tree = tree
        trees = None if tree is None else TreeVerification(tree, self.sampler, model, device)
        self.speculative = None if proposer is None else SpeculativeDecoding(
            proposer, self.sampler, device, trees, places_on_device=attn_backend.supports_device_positions)
        """Drafts and verification; None without speculative decoding."""
        self._last_sampled: torch.Tensor | None = None  # [n] the last launched step's tokens, on the device
        self._last_pending: PendingOutput | None = None
        self._deferred: DeferredSample | None = None  # the last step, if its sampler waits for its grammar masks
        self._ahead: VerifyAhead | None = None  # this step, if launched before the last one's tokens reached the host
        # Pinned landing buffers for sampled tokens, one per step launched before the oldest one's copy is read:
        # a step and the next under async scheduling, a step per micro-batch in flight under pipeline stages.
        pinned = device.type == "cuda"
        # A verifying step's rows carry a count and up to 1 + max_drafts tokens.
        width = 1 if max_drafts == 0 else 2 + max_drafts
        self._host_buffers = [torch.empty(max_num_reqs * width, dtype=torch.int64, pin_memory=pinned)
                              for _ in range(max(2, num_batches_in_flight))]
        drafting = self.speculative is not None and self.speculative.drafts_after_verify
        self._draft_buffers = [torch.empty(max_num_reqs * max_drafts, dtype=torch.int64, pin_memory=pinned)
                               for _ in range(2)] if drafting and pinned else None
        """Pinned landing buffers of the drafts made right after a verification (SpeculativeDecoding.draft_next)."""
        self._num_launched = 0
        self._long_prompts = long_prompt_flags(model)
        self.stage = get_pp_stage()
        """This rank's pipeline stage: only the last one computes logits and samples."""

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> PendingOutput | DeferredSample | ReadyOutput:
        """Queue one step on the device; the returned output's result() waits for its tokens."""
        if self._deferred is not None:  # the last step's sampler, its masks filled meanwhile: before anything else
            self._deferred, deferred = None, self._deferred
            deferred.launch()
        for request_id in scheduler_output.finished_request_ids:
            self.prompt_logprobs.drop(request_id)
        if self.speculative is not None:
            self.speculative.drop_finished(scheduler_output.finished_request_ids, self.states)
        for row, new in self.states.apply(scheduler_output):
            self.sampling_state.add_request(
                row, new.sampling_params, new.eos_token_ids, new.token_ids, new.num_prompt_tokens
            )
            if new.sampling_params.structured_outputs is not None and self.stage.is_last:
                # A resumed request's matcher replays its output at its next sampling.
                self.grammar_rows.add(row, self.states, new.eos_token_ids)
            # Only a fresh prompt yields prompt logprobs; a resumed request already returned them.
            if new.sampling_params.prompt_logprobs is not None and len(new.token_ids) == new.num_prompt_tokens:
                self.prompt_logprobs.start(new.request_id)
        if scheduler_output.is_empty:
            return EMPTY_OUTPUT
        last = self._last_pending
        self._ahead = None
        if self.speculative is not None and self.speculative.launches_ahead and not self.prompt_logprobs.pending:
            self._ahead = verify_ahead(scheduler_output, self.states, last, self.sampling_state.needs_host_pass)
        if self._ahead is None and last is not None and (last.verified is not None
                                                         or scheduler_output.num_lookahead_tokens):
            # Drafts need the last step's tokens on the host, and after a verifying step so do the positions.
            last.result()
            self.states.last_step_index.fill(-1)
        # A grammar process gets the last step's tokens as soon as they are on the host (looked at here and before
        # the launch, never waited for), and the step's mask request before the launch if it can: it accepts and
        # fills while this step is launched. (Matchers in this process work after the launch instead, so that
        # the device runs the forward pass meanwhile.)
        # (Not in a step launched ahead: none of its rows has a grammar, and the last step's tokens must stay off
        # the host until it is launched: its layout counts on that. The matchers take them later.)
        grammars_early = self.grammar_rows is not None and self.grammar_rows.works_apart and self._ahead is None
        if grammars_early:
            self.grammar_rows.send_ready_tokens(last, self.states)
        num_drafts = num_ahead = None
        if self._ahead is not None:  # its first inputs: the tokens the last step emitted last, on the device
            num_drafts, num_ahead = self.speculative.take_drafts_ahead(self._ahead), self._ahead.num_ahead
            self._last_sampled = self._ahead.last_emitted()
        elif scheduler_output.num_lookahead_tokens and self.speculative is not None:
            num_drafts = self.speculative.propose(scheduler_output, self.states)
        batch = prepare_inputs(scheduler_output, self.states, self.block_size, num_drafts, self.tree, num_ahead)
        self.states.num_computed_tokens[batch.rows] += batch.num_new
        constrained = None
        if grammars_early and self.grammar_rows.send_ready_tokens(last, self.states):
            constrained = self.grammar_rows.start_step(batch, self.states)
        hidden_states = self._forward(batch)
        aux_hidden_states = None
        if isinstance(hidden_states, tuple):  # the target also hands over inner layers' states (EAGLE-3)
            hidden_states, aux_hidden_states = hidden_states
        if self.speculative is not None:
            self.speculative.observe(batch, self.states, hidden_states, aux_hidden_states)
        if self.prompt_logprobs.pending and self.stage.is_last:
            self._collect_prompt_logprobs(batch, hidden_states)
        if len(batch.sampled_rows) == 0:
            return EMPTY_OUTPUT
        return self._sample(batch, hidden_states, constrained)

    def _forward(self, batch: InputBatch) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The last hidden states, and the auxiliary layers' where a proposer asked the model for them."""
        # One host-to-device copy: the inputs, and the indices that fill some of them in from the device.
        arrays = [batch.input_ids, batch.positions]
        if len(batch.last_token_dst):
            arrays.append(np.stack([batch.last_token_dst, batch.last_token_src]))
        places = shift = None
        if self.speculative is not None:
            places = self.speculative.draft_places(batch)
            shift = None if self._ahead is None else self.speculative.ahead_shift(batch)
        if places is not None:
            arrays.append(places)
        if shift is not None:
            arrays.append(shift[0])
        if self._long_prompts is not None:  # longrope: which tokens' requests have prompts past the pretrained context
            flags, pretrained_len = self._long_prompts
            arrays.append(np.repeat(self.states.num_prompt_tokens[batch.rows] > pretrained_len,
                                    np.diff(batch.query_start_loc)).astype(np.int64))
        input_ids, positions, *indices = pack_to_device(arrays, self.device)[2]
        if self._long_prompts is not None:
            step_flags = indices.pop()
            flags[: len(step_flags)].copy_(step_flags)
        if len(batch.last_token_dst):
            self._last_pending.wait_for_tokens()
            dst, src = indices.pop(0)
            input_ids[dst] = self._last_sampled[src]
        if self.speculative is not None:
            self.speculative.place_drafts(input_ids, indices.pop(0) if places is not None else None)
        place = None
        if shift is not None:  # laid out as if the last step's drafts all stood (worker/verify_ahead.py)
            positions = positions - shift[1][indices.pop(0)]
            place = lambda metadata: self.attn_backend.place_decodes(metadata, positions, self.block_size)  # noqa: E731
        # Positions moved on the device fit the one-token-per-request graphs only.
        for graphs in (self.cuda_graphs,) if place is not None else (self.cuda_graphs, self.mixed_cuda_graphs):
            if graphs is not None:
                hidden_states = graphs.run(batch.layout, input_ids, positions, place=place)
                if hidden_states is not None:
                    return hidden_states
        metadata = self.attn_backend.build_metadata(batch.layout, self.device)
        if place is not None:
            place(metadata)
        with forward_context(self.attn_backend, metadata):
            return self.model(input_ids, positions)

    def _sample(self, batch: InputBatch, hidden_states: torch.Tensor,
                constrained: list[int] | None) -> PendingOutput | DeferredSample:
        """`constrained`: the rows whose masks began before the forward pass (None: not begun)."""
        if not self.stage.is_last:  # the last stage samples; this rank keeps its rows with the driver's tokens
            tokens, arrival = receive_sampled_tokens(batch, self.device)
            return self._pending_output(batch, tokens, arrival=arrival)
        logits = self.model.compute_logits(hidden_states[self._to_device(batch.logits_indices)])
        rows = batch.sampled_rows
        last = self._last_pending
        if last is not None and self.sampling_state.needs_output_ids[rows].any():
            last.result()  # the slow path reads the last step's tokens on the host
        under_grammar = [] if constrained is not None or self.grammar_rows is None else \
            self.grammar_rows.constrained(rows, self.states)
        defers = bool(under_grammar or constrained) and self.stage.num_stages == 1 and \
            self.grammar_rows.defers_sampler(batch)
        if under_grammar:
            # The grammars read the last step's tokens on the host, which were not there before the forward pass.
            if defers and last is not None and not last.has_tokens():
                # Handed over when the engine takes them (its update of the last step, after this launch) rather
                # than waited for here: the last step's sampler was launched only now, at the start of this step.
                last.when_tokens(functools.partial(self._start_grammars, batch, under_grammar))
                self._deferred = DeferredSample(functools.partial(self._finish_sample, batch, logits, under_grammar),
                                                before=last.result)
                return self._deferred
            if last is not None:
                last.result()
            constrained = self.grammar_rows.start_step(batch, self.states, under_grammar)
        if constrained and defers:
            # The sampler waits for the grammar process's masks until the engine's other host work is done.
            self._deferred = DeferredSample(functools.partial(self._finish_sample, batch, logits, constrained))
            return self._deferred
        return self._finish_sample(batch, logits, constrained)

    def _start_grammars(self, batch: InputBatch, constrained: list[int]) -> None:
        """The masks of `batch`'s `constrained` rows begun, once the last step's tokens are on the host: its
        tokens and the mask request go as one message (`start` accepts what a row's matcher has not had)."""
        self.grammar_rows.start_step(batch, self.states, constrained)

    @torch.inference_mode()  # also when the engine's wait for the tokens launches it
    def _finish_sample(self, batch: InputBatch, logits: torch.Tensor, constrained: list[int]) -> PendingOutput:
        """Mask (the grammars' masks begun), sample or verify the drafts, and queue the tokens' way to the host."""
        rows = batch.sampled_rows
        metadata = self.sampling_state.build_metadata(rows, self.states)
        grammar_left_none = self.grammar_rows.apply(logits) if constrained else None  # [logits rows] on the device
        verifying = bool(batch.sampled_num_drafts.any())
        # Each row samples at its last logits row (a verifying row after its drafts' rows).
        last_rows = np.cumsum(1 + batch.sampled_num_drafts) - 1 if verifying else None
        self.sampling_state.thinking.force(logits, rows, last_rows)  # thinking budgets never draft: see can_draft
        if verifying:
            # Every row's sampled (last) position is checked for a token left, as in a step without drafts: the rows
            # beside the verifying ones may have none (a grammar with bans, bad_words: they never draft).
            none_left = rows_without_token(logits, metadata, logit_rows=last_rows)
            tokens, output = self.speculative.sample_and_verify(logits, batch, metadata, self.states,
                                                                self.sampling_state)
            if grammar_left_none is not None:
                dead_ends = emitted_from_nothing(grammar_left_none, batch.sampled_num_drafts, tokens.num_emitted,
                                                 tokens.token_ids.shape[1], self.speculative.tree is not None)
                none_left = dead_ends if none_left is None else none_left.unsqueeze(1) | dead_ends
        else:
            none_left = rows_without_token(logits, metadata)
            output = self.sampler(logits, metadata)
            tokens = output.token_ids
            if grammar_left_none is not None:
                none_left = grammar_left_none if none_left is None else none_left | grammar_left_none
        if self.stage.num_stages > 1:
            share_sampled_tokens(tokens)
        self.sampling_state.record_sampled(rows, output.token_ids, metadata.penalty_rows)
        num_logprobs = None
        if output.logprobs is not None:
            num_logprobs = [self.states.sampling_params[row].logprobs for row in rows.tolist()]
        prompt_logprobs = {}
        if self.prompt_logprobs.pending:
            for rid in self._sampled_request_ids(batch):
                taken = self.prompt_logprobs.take(rid)
                if taken is not None:
                    prompt_logprobs[rid] = taken
        pending = self._pending_output(batch, tokens, output.logprobs, num_logprobs, prompt_logprobs,
                                       none_left=none_left)
        if verifying and (drafted := self.speculative.draft_next(self.states)) is not None:
            buffers = self._draft_buffers
            pending.add_next_drafts(*drafted, None if buffers is None else buffers[self._num_launched % 2])
        return pending

    def _pending_output(self, batch: InputBatch, tokens: torch.Tensor | VerifiedTokens, logprobs=None,
                        num_logprobs=None, prompt_logprobs=None, arrival=None, none_left=None) -> PendingOutput:
        """`none_left`: [n] bool, the rows that had no token to sample (sample/no_token.py): -1 on the host (a
        verifying step's may be [n, columns]: the emitted tokens that were drawn from nothing)."""
        rows = batch.sampled_rows
        positions = self.states.reserve_sampled_tokens(rows)
        # After a verifying step the next one reads every input on the host (execute_model waits for it).
        self._last_sampled = None if isinstance(tokens, VerifiedTokens) else tokens
        self._num_launched += 1
        ahead_of = None
        if self._ahead is not None:
            assert not self._ahead.last.is_done, "the last step's tokens reached the rows while this one launched ahead"
            ahead_of = (self._ahead.last, self._ahead.index)
        self._last_pending = PendingOutput(
            self.states, self._sampled_request_ids(batch), rows, positions, tokens, logprobs, num_logprobs,
            prompt_logprobs, host_buffer=self._host_buffers[self._num_launched % len(self._host_buffers)],
            arrival=arrival, none_left=none_left, ahead_of=ahead_of,
        )
        return self._last_pending

    @staticmethod
    def _sampled_request_ids(batch: InputBatch) -> list[str]:
        row_to_id = dict(zip(batch.rows.tolist(), batch.request_ids))
        return [row_to_id[row] for row in batch.sampled_rows.tolist()]

    def _collect_prompt_logprobs(self, batch: InputBatch, hidden_states: torch.Tensor) -> None:
        starts = batch.query_start_loc
        for i, (rid, row) in enumerate(zip(batch.request_ids, batch.rows.tolist())):
            if rid not in self.prompt_logprobs.pending:
                continue
            first = int(batch.positions[starts[i]])
            # Positions whose successor is still a prompt token.
            last = min(int(batch.positions[starts[i + 1] - 1]) + 1, int(self.states.num_prompt_tokens[row]) - 1)
            next_ids = self.states.token_ids[row, first + 1 : last + 1].tolist()
            params = self.states.sampling_params[row]
            self.prompt_logprobs.collect(
                rid, hidden_states[starts[i] : starts[i] + len(next_ids)], next_ids, params.prompt_logprobs,
                self.model.compute_logits,
            )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)
