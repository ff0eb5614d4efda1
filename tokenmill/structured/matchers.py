"""The worker's grammar state: one xgrammar matcher per constrained row, and each step's token bitmask.

A row's matcher is advanced with the tokens its request emitted since the last step (on the host: the
runner waits for the last step's tokens before sampling a constrained row), then fills the row's bitmask
of allowed next tokens (packed int32, 32 tokens a word), which is applied to the logits on the device
before anything else of sampling. A request resumed after preemption gets a fresh matcher that replays
its output so far. With speculative decoding the matcher walks through the step's drafts to mask every
draft position (the rejection sampler then sees the constrained distribution there too), and rolls back.

Per step, in the shadow of the forward pass that the runner has already queued: every row's new tokens go
to the matchers in one xgrammar call and every mask is filled in another (xgrammar's BatchGrammarMatcher:
its C++ threads, as many as fill_threads says, fill rows in parallel; the call blocks the calling thread),
into a pinned host buffer; one non-blocking copy takes the buffer (the logits rows' index and the masks)
to the device, and one kernel (kernels/token_bitmask.py) writes -inf where a bit is clear. The host
buffers are two, used in turn, each reused only once the copy from it has run: the copy is queued behind
the forward pass, so the next step may fill before it is done.

The masks cover the grammars' vocabulary, the tokenizer's (structured/vocab.py), which may be narrower than
the model's logits: the kernel forbids the ids past it.
"""

from __future__ import annotations

import functools
import logging
import os
import sys

import numpy as np
import torch

from tokenmill.kernels import use_triton
from tokenmill.structured.compiler import GrammarCompiler
from tokenmill.worker.request_state import RequestStates

logger = logging.getLogger(__name__)

MAX_FILL_THREADS = 8
ROWS_PER_FILL_THREAD = 32
"""xgrammar starts its fill threads anew at every call (and joins them): a thread per 32 rows, at most 8."""


@functools.cache
def _usable_fill_threads() -> int:
    """Half the CPUs this process may use (asked once: the fill runs every step)."""
    return max(1, len(os.sched_getaffinity(0)) // 2)


def fill_threads(num_rows: int) -> int:
    """Threads for one batched fill. Not xgrammar's 'auto' (half of std::thread::hardware_concurrency()): that
    counts the host's CPUs, not this process's (a GPU lease may see 16 of a host's hundreds)."""
    return max(1, min(MAX_FILL_THREADS, _usable_fill_threads(), num_rows // ROWS_PER_FILL_THREAD))


class GrammarRows:
    def __init__(self, compiler: GrammarCompiler, vocab_size: int, device: torch.device) -> None:
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.device = device
        self.grammar_vocab_size: int | None = None
        """The grammars' vocabulary (structured/vocab.py): the masks' width; known at the first add."""
        self._words = 0
        # Per row, sized on first use (the rows' count is the request states'):
        self._active: np.ndarray | None = None  # [rows] bool: the row has a matcher
        self._generation: np.ndarray | None = None  # [rows] the row's generation when its matcher was made
        self._accepted: np.ndarray | None = None  # [rows] output tokens its matcher has accepted
        self._matchers: list = []
        self._batches: dict[int, object] = {}  # xgrammar's BatchGrammarMatcher by its number of fill threads
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
        compiled = self.compiler.get(params)
        if self.grammar_vocab_size is None:
            self.grammar_vocab_size = compiled.tokenizer_info.vocab_size  # xgrammar fills masks this wide
            self._words = -(-self.grammar_vocab_size // 32)
        # A stop token past the grammar's vocabulary cannot be sampled under it (the mask forbids it).
        stop_tokens = sorted(t for t in eos_token_ids if t < self.grammar_vocab_size)
        if eos_token_ids and not stop_tokens:
            logger.warning("row %d: every stop token (%s) lies past the grammars' %d-token vocabulary: its output "
                           "ends at the grammar's end only through max_tokens", row, sorted(eos_token_ids),
                           self.grammar_vocab_size)
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_tokens or None)
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
        chosen = np.asarray(constrained, dtype=np.int64)
        grammar_rows = rows[chosen]
        matchers = [self._matchers[row] for row in grammar_rows.tolist()]
        drafts = np.asarray(num_drafts)[chosen]
        starts = np.asarray(first_logit_rows)[chosen]
        num_masks = len(chosen) + int(drafts.sum())
        buffer, index, bitmask = self._host_buffer(num_masks)
        self._accept_new_tokens(grammar_rows, matchers, states)
        if not drafts.any():
            index[:] = starts
            self._fill(matchers, bitmask, range(len(matchers)))
        else:
            self._fill_with_drafts(grammar_rows, matchers, starts, drafts, index, bitmask, states)
        self._apply(logits, buffer, num_masks, index)

    def _accept_new_tokens(self, grammar_rows: np.ndarray, matchers: list, states: RequestStates) -> None:
        """Advance each matcher through the tokens its request emitted since it last accepted. On this thread,
        not split over Python threads: xgrammar 0.2.9's calls (tvm-ffi bindings) did not run in parallel from
        two threads, and at the default GIL switch interval the same calls took 70-100x longer from two
        threads than from one (2-core machine). Neither can a Python thread overlap them with the engine's
        other host work (a job of ~1 ms finished only after a 6 ms busy main thread did)."""
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
            self._batch(len(live)).batch_fill_next_token_bitmask(live, bitmask, live_slots)

    def _batch(self, num_rows: int):
        import xgrammar as xgr

        threads = fill_threads(num_rows)
        if threads not in self._batches:
            self._batches[threads] = xgr.BatchGrammarMatcher(threads)
        return self._batches[threads]

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

            apply_token_bitmask(logits, bitmask, index, self.grammar_vocab_size)
        else:
            forbidden = ~unpack_bitmask(bitmask, logits.shape[-1], self.grammar_vocab_size)
            if (np.diff(host_index) == 1).all():  # consecutive logits rows (all sampled rows constrained, say)
                first = int(host_index[0])
                logits[first : first + num_masks].masked_fill_(forbidden, float("-inf"))  # in place: one pass
            else:
                index = index.long()
                logits[index] = logits[index].masked_fill(forbidden, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int, grammar_vocab_size: int | None = None) -> torch.Tensor:
    """[n, words] int32, bit b of word w = token 32 w + b allowed -> [n, vocab_size] bool.

    Logits wider than the bitmask, or than `grammar_vocab_size` (a model vocabulary padded past the one the
    grammar was compiled for: the tokenizer's), have their extra tokens forbidden."""
    if grammar_vocab_size is not None and grammar_vocab_size < vocab_size:
        allowed = unpack_bitmask(bitmask, grammar_vocab_size)
        return torch.nn.functional.pad(allowed, (0, vocab_size - grammar_vocab_size), value=False)
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
