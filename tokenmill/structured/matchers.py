"""The worker's grammar state: one xgrammar matcher per constrained row, and each step's token bitmask.

A row's matcher is advanced with the tokens its request emitted since the last step (on the host: the
runner waits for the last step's tokens before sampling a constrained row), then fills the row's bitmask
of allowed next tokens (packed int32, 32 tokens a word), which is applied to the logits on the device
before anything else of sampling. A request resumed after preemption gets a fresh matcher that replays
its output so far. With speculative decoding the matcher walks through the step's drafts to mask every
draft position (the rejection sampler then sees the constrained distribution there too), and rolls back.

Per step, in the shadow of the forward pass that the runner has already queued: every row's new tokens go
to the matchers in one xgrammar call and every mask is filled in another (xgrammar's BatchGrammarMatcher:
its threads fill rows in parallel, without the GIL), into a pinned host buffer; one non-blocking copy takes
the buffer (the logits rows' index and the masks) to the device, and one kernel (kernels/token_bitmask.py)
writes -inf where a bit is clear. The host buffers are two, used in turn, each reused only once the copy
from it has run: the copy is queued behind the forward pass, so the next step may fill before it is done.
"""

from __future__ import annotations

import logging
import sys

import numpy as np
import torch

from tokenmill.kernels import use_triton
from tokenmill.structured.compiler import GrammarCompiler
from tokenmill.worker.request_state import RequestStates

logger = logging.getLogger(__name__)


class GrammarRows:
    def __init__(self, compiler: GrammarCompiler, vocab_size: int, device: torch.device) -> None:
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.device = device
        self._words = -(-vocab_size // 32)
        # Per row, sized on first use (the rows' count is the request states'):
        self._active: np.ndarray | None = None  # [rows] bool: the row has a matcher
        self._generation: np.ndarray | None = None  # [rows] the row's generation when its matcher was made
        self._accepted: np.ndarray | None = None  # [rows] output tokens its matcher has accepted
        self._matchers: list = []
        self._batch = None  # xgrammar's BatchGrammarMatcher (its fill thread pool), made on first use
        self._capacity = 0  # masks a buffer holds
        self._host: list[torch.Tensor] = []  # two int32 [capacity + capacity * words]: logits rows, then masks
        self._copied: list[torch.cuda.Event | None] = [None, None]  # each host buffer's last copy
        self._turn = 0
        self._on_device: torch.Tensor | None = None

    def add(self, row: int, states: RequestStates, eos_token_ids: frozenset[int]) -> None:
        import xgrammar as xgr

        if self._active is None:
            num_rows = len(states.row_generation)
            self._active = np.zeros(num_rows, dtype=bool)
            self._generation = np.zeros(num_rows, dtype=np.int64)
            self._accepted = np.zeros(num_rows, dtype=np.int64)
            self._matchers = [None] * num_rows
        params = states.sampling_params[row].structured_outputs
        matcher = xgr.GrammarMatcher(self.compiler.get(params), override_stop_tokens=sorted(eos_token_ids) or None)
        self._matchers[row] = matcher
        self._active[row] = True
        self._generation[row] = states.row_generation[row]
        self._accepted[row] = 0

    def constrained(self, rows: np.ndarray, states: RequestStates) -> list[int]:
        """Indices into `rows` of the rows under a grammar (a row reused by another request is dropped)."""
        if self._active is None:
            return []
        active = self._active[rows]
        if not active.any():
            return []
        stale = active & (self._generation[rows] != states.row_generation[rows])
        if stale.any():
            for row in rows[stale].tolist():
                self._active[row], self._matchers[row] = False, None
            active &= ~stale
        return np.flatnonzero(active).tolist()

    def apply(self, logits: torch.Tensor, rows: np.ndarray, first_logit_rows: np.ndarray, num_drafts: np.ndarray,
              states: RequestStates, constrained: list[int]) -> None:
        """Mask the tokens the grammar of row `rows[i]` (i in `constrained`) forbids, in its logits rows
        `first_logit_rows[i]` .. `+ num_drafts[i]`: one per draft position (the grammar having accepted the
        drafts before it), then the position after the drafts. The rows' tokens must be on the host."""
        import xgrammar as xgr

        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher()
        chosen = np.asarray(constrained, dtype=np.int64)
        grammar_rows = rows[chosen]
        matchers = [self._matchers[row] for row in grammar_rows.tolist()]
        self._accept_new_tokens(grammar_rows, matchers, states)
        drafts = np.asarray(num_drafts)[chosen]
        starts = np.asarray(first_logit_rows)[chosen]
        num_masks = len(chosen) + int(drafts.sum())
        buffer, index, bitmask = self._host_buffer(num_masks)
        if not drafts.any():
            index[:] = starts
            self._fill(matchers, bitmask, range(len(matchers)))
        else:
            self._fill_with_drafts(grammar_rows, matchers, starts, drafts, index, bitmask, states)
        self._apply(logits, buffer, num_masks, index)

    def _accept_new_tokens(self, grammar_rows: np.ndarray, matchers: list, states: RequestStates) -> None:
        """Advance each matcher through the tokens its request emitted since it last accepted."""
        import xgrammar as xgr

        start = states.num_prompt_tokens[grammar_rows] + self._accepted[grammar_rows]
        count = states.num_tokens[grammar_rows] - start
        refused_tokens = []
        single = count == 1  # the usual step: one new token per row, all in one call
        if single.any():
            one = np.flatnonzero(single)
            tokens = states.token_ids[grammar_rows[one], start[one]].tolist()
            accepted = xgr.BatchGrammarMatcher.batch_accept_token([matchers[i] for i in one.tolist()], tokens)
            if not all(accepted):
                refused_tokens += [(int(grammar_rows[i]), t) for i, t, ok in zip(one, tokens, accepted) if not ok]
        # A resumed request replays its output; after a verifying step a row may have emitted several.
        for i in np.flatnonzero(~single & (count > 0)).tolist():
            row = int(grammar_rows[i])
            for token in states.token_ids[row, start[i] : start[i] + count[i]].tolist():
                if not matchers[i].accept_token(token):
                    refused_tokens.append((row, token))
        for row, token in refused_tokens:
            logger.warning("grammar of row %d refused token %d it had allowed", row, token)
        self._accepted[grammar_rows] += np.maximum(count, 0)

    def _fill(self, matchers: list, bitmask: np.ndarray, slots) -> None:
        """Each matcher's mask into its slot of `bitmask`: all in one call, but for terminated matchers."""
        live, live_slots = [], []
        for matcher, slot in zip(matchers, slots):
            if matcher.is_terminated():
                # Past the stop token: a draft there is rejected by the position before, and a step that
                # async scheduling ran past its end is discarded, so any token will do.
                bitmask[slot] = -1
            else:
                live.append(matcher)
                live_slots.append(slot)
        if live:
            self._batch.batch_fill_next_token_bitmask(live, bitmask, live_slots)

    def _fill_with_drafts(self, grammar_rows: np.ndarray, matchers: list, starts: np.ndarray, drafts: np.ndarray,
                          index: np.ndarray, bitmask: np.ndarray, states: RequestStates) -> None:
        """Speculation: a row's masks for its draft positions and the one after, walking the drafts (one
        batched fill per position across the rows), then back to the known tokens."""
        first_slot = np.cumsum(drafts + 1) - (drafts + 1)
        index[:] = np.repeat(starts - first_slot, drafts + 1) + np.arange(len(index))
        lengths = states.num_tokens[grammar_rows]
        num_accepted = np.zeros(len(matchers), dtype=np.int64)
        alive = list(range(len(matchers)))
        for position in range(int(drafts.max()) + 1):
            self._fill([matchers[i] for i in alive], bitmask, [int(first_slot[i]) + position for i in alive])
            walking = []
            for i in alive:
                if position == drafts[i]:
                    continue
                matcher = matchers[i]
                draft = int(states.token_ids[grammar_rows[i], lengths[i] + position])
                if matcher.is_terminated() or not matcher.accept_token(draft):
                    # The mask rejects this draft: the positions after it are never used.
                    bitmask[first_slot[i] + position + 1 : first_slot[i] + drafts[i] + 1] = -1
                    continue
                num_accepted[i] += 1
                walking.append(i)
            alive = walking
        for i in np.flatnonzero(num_accepted).tolist():
            matchers[i].rollback(int(num_accepted[i]))  # back to the known tokens: the drafts may yet be rejected

    def _host_buffer(self, num_masks: int) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """This step's host buffer, once the copy from its last use has run, with its numpy views: the masks'
        logits rows (int32) and the masks [num_masks, words]. xgrammar gets the masks as numpy, whose DLPack
        device is plain CPU: a pinned tensor's is CUDA-host memory, which not every xgrammar release takes."""
        if num_masks > self._capacity:
            self._capacity = -(-max(num_masks, 2 * self._capacity) // 64) * 64
            pinned = self.device.type == "cuda"
            size = self._capacity * (1 + self._words)
            # The old buffers may still be in flight: the caching host allocator keeps them until their copies ran.
            self._host = [torch.empty(size, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
            self._copied = [None, None]
            self._on_device = torch.empty(size, dtype=torch.int32, device=self.device) if pinned else None
        self._turn ^= 1
        if self._copied[self._turn] is not None:
            self._copied[self._turn].synchronize()  # done in practice: it was queued a step before the last
        buffer = self._host[self._turn]
        index = buffer[:num_masks].numpy()
        bitmask = buffer[self._capacity : self._capacity + num_masks * self._words].numpy()
        return buffer, index, bitmask.reshape(num_masks, self._words)

    def _apply(self, logits: torch.Tensor, buffer: torch.Tensor, num_masks: int, host_index: np.ndarray) -> None:
        end = self._capacity + num_masks * self._words
        if self._on_device is not None:
            # One copy (rows and masks), queued behind the forward pass without blocking the host.
            self._on_device[:end].copy_(buffer[:end], non_blocking=True)
            event = self._copied[self._turn] = torch.cuda.Event()
            event.record()
            buffer = self._on_device
        index = buffer[:num_masks]
        bitmask = buffer[self._capacity : end].view(num_masks, self._words)
        if use_triton(logits):
            from tokenmill.kernels.token_bitmask import apply_token_bitmask

            apply_token_bitmask(logits, bitmask, index, self.vocab_size)
        else:
            forbidden = ~unpack_bitmask(bitmask, logits.shape[-1])
            if (np.diff(host_index) == 1).all():  # consecutive logits rows (all sampled rows constrained, say)
                first = int(host_index[0])
                logits[first : first + num_masks].masked_fill_(forbidden, float("-inf"))  # in place: one pass
            else:
                index = index.long()
                logits[index] = logits[index].masked_fill(forbidden, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, words] int32, bit b of word w = token 32 w + b allowed -> [n, vocab_size] bool.

    Logits wider than the bitmask (a model vocabulary padded past the one the grammar was compiled for)
    have their extra tokens forbidden; the ids between the tokenizer's vocabulary and the model's are
    already forbidden by xgrammar (its TokenizerInfo, given the model's vocab_size, marks them special)."""
    if bitmask.device.type == "cpu" and sys.byteorder == "little":
        # numpy unpacks bits ~20x faster than the shifts below on the CPU (each int32 is 4 bytes, low first).
        packed = np.ascontiguousarray(bitmask.numpy()).view(np.uint8)
        allowed = torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little").view(np.bool_))
    else:
        bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
        allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).reshape(bitmask.shape[0], -1).bool()
    if allowed.shape[1] < vocab_size:
        return torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    return allowed[:, :vocab_size]
