"""The worker's grammar state: which rows are under a grammar, their matchers, and each step's token bitmask.

A row's matcher (structured/matcher_set.py) is advanced with the tokens its request emitted since the last
step, then fills the row's bitmask of allowed next tokens (packed int32, 32 tokens a word), which is applied to
the logits on the device before anything else of sampling. A request resumed after preemption gets a fresh
matcher that replays its output so far. With speculative decoding the matcher walks through the step's drafts
to mask every draft position (the rejection sampler then sees the constrained distribution there too), and
rolls back; with draft trees it walks the tree depth first, masking each node's logits row with the grammar's
state after the node's path (matcher_set.py), so the tree's verification sees constrained distributions too.

The matchers live in a grammar process of their own on a GPU host with cores to spare (grammar_process.py;
`use_grammar_process`), else in this process. A step is split so that the grammar process works while the
engine does its other host work: `send_tokens` as soon as the last step's tokens are on the host, `start` once
the step's sampled rows and drafts are known (the fill is requested), `apply` just before the sampler (waits for
the masks), which the runner then launches only at the start of its next step (worker/pending_output.py's
DeferredSample). The last step's tokens are then mostly still on the device when the step is launched (its
sampler was launched only at that step's start): its `start` waits for the engine's update of the last step,
which takes them (PendingOutput.when_tokens), rather than the launch waiting for them. In this process the same
calls do the work where they are made, after the forward launch.

The masks go into a host buffer (pinned on a GPU; shared memory the grammar process writes into when it is
used); one non-blocking copy takes the buffer (the logits rows' index, a byte per logits row set where a mask
applies, and the masks) to the device, and one kernel (kernels/token_bitmask.py) writes -inf where a bit is
clear and clears the byte of a row whose mask allows a token. A row whose byte stays set had no token left
(a grammar in a state no token continues): `apply` returns those bytes for the runner to end such requests as
it ends those whose bans leave nothing (sample/no_token.py), where the draw would return a token the grammar
refuses. The host buffers are two, used in turn, each refilled only once the copy from it has run: the copy is
queued behind the forward pass, so the next step may fill before it is done.

The masks cover the grammars' vocabulary, the tokenizer's (structured/vocab.py), which may be narrower than
the model's logits: the kernel forbids the ids past it.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.kernels import use_triton
from tokenmill.structured.compiler import GrammarCompiler
from tokenmill.structured.matcher_set import MatcherSet
from tokenmill.worker.request_state import RequestStates

if TYPE_CHECKING:
    from tokenmill.spec.tree import TokenTree
    from tokenmill.worker.input_batch import InputBatch
    from tokenmill.worker.pending_output import PendingOutput

logger = logging.getLogger(__name__)

MIN_CPUS_FOR_PROCESS = 4
"""A grammar process pays off only with a core of its own beside the engine's (and xgrammar's fill threads)."""


def use_grammar_process(device: torch.device) -> bool:
    """The matchers in a process of their own: on a GPU with cores to spare. Not on the CPU backend, whose
    forward pass already takes the host's cores (and runs synchronously: nothing to overlap)."""
    return device.type == "cuda" and len(os.sched_getaffinity(0)) >= MIN_CPUS_FOR_PROCESS


class LocalMatchers:
    """The matchers in this process: each call does its work at once."""

    def __init__(self, compiler: GrammarCompiler, tree_parent: np.ndarray | None = None) -> None:
        self._compiler = compiler
        self._set = MatcherSet(tree_parent)

    def new_buffers(self, num_int32: int, pinned: bool) -> list[torch.Tensor]:
        return [torch.empty(num_int32, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]

    def add(self, row: int, params, stop_tokens: list[int]) -> None:
        self._set.add(row, self._compiler.get(params), stop_tokens)

    def accept(self, rows: np.ndarray, counts: np.ndarray, tokens: np.ndarray) -> None:
        self._set.accept(rows, counts, tokens)

    def fill(self, turn: int, offset: int, bitmask: np.ndarray, rows: np.ndarray, num_drafts: np.ndarray,
             drafts: np.ndarray, accept: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
        if accept is not None:
            self._set.accept(*accept)
        self._set.fill(rows, num_drafts, drafts, bitmask)

    def take(self) -> None:
        pass

    def close(self) -> None:
        pass


class GrammarRows:
    def __init__(self, compiler: GrammarCompiler, vocab_size: int, device: torch.device,
                 in_process: bool | None = None, tree: TokenTree | None = None) -> None:
        """`in_process`: the matchers here (True) or in a grammar process (False); None: use_grammar_process.
        `tree`: the draft tree (speculative_token_tree) whose nodes a row's drafts are; None: chains."""
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.device = device
        self.grammar_vocab_size: int | None = None
        """The grammars' vocabulary (structured/vocab.py): the masks' width; known at the first add."""
        self._words = 0
        if in_process is None:
            in_process = not use_grammar_process(device)
        tree_parent = None if tree is None else tree.parent
        if in_process:
            self._matchers = LocalMatchers(compiler, tree_parent)
        else:
            from tokenmill.structured.grammar_process import GrammarProcess

            # It compiles the compiler's grammars from now on, each once: in a one-process engine the compiler is
            # the engine core's, whose requests wait for the grammar process's compiles (compiler.py).
            self._matchers = GrammarProcess(compiler, tree_parent)
        self._pending: dict[int, tuple[int, frozenset[int]]] = {}
        """Rows added whose matcher is made at their first sampling: row -> (its generation then, stop tokens)."""
        # Per row, sized on first use (the rows' count is the request states'):
        self._active: np.ndarray | None = None  # [rows] bool: the row has a matcher
        self._generation: np.ndarray | None = None  # [rows] the row's generation when its matcher was made
        self._accepted: np.ndarray | None = None  # [rows] output tokens sent to its matcher
        self._capacity = 0  # masks, and logits rows, a buffer holds
        # Two int32 [capacity + capacity / 4 + capacity * words]: the masks' logits rows, a byte per logits row
        # (set: its mask allows nothing, until the kernel sees a token), then the masks.
        self._host: list[torch.Tensor] = []
        self._host_numpy: list[np.ndarray] = []  # their numpy views (made once: a view costs microseconds a step)
        self._copy_events: list[torch.cuda.Event] | None = None  # one per buffer pair, recorded at each copy
        self._copied: list[torch.cuda.Event | None] = [None, None]  # each buffer pair's last copy
        self._turn = 0
        # On a GPU, a device buffer per host buffer, filled on a stream of its own: the copy runs beside the forward
        # pass still on the device rather than after it (~50 us a step at 256 rows); each buffer's last mask kernel
        # is waited for before the next copy into it.
        self._on_device: list[torch.Tensor] = []
        self._copy_stream: torch.cuda.Stream | None = None
        self._consumed: list[torch.cuda.Event] = []
        self._started: tuple[torch.Tensor, int, np.ndarray, int] | None = None
        """The step's buffer, its number of masks, their logits rows, the step's number of logits rows."""
        self._tokens_from: PendingOutput | None = None  # the last step whose tokens send_ready_tokens sent

    @property
    def in_process(self) -> bool:
        return isinstance(self._matchers, LocalMatchers)

    @property
    def works_apart(self) -> bool:
        """Whether a grammar process holds the matchers and a row may be under a grammar: the runner then hands
        over the tokens as early as it can (`send_ready_tokens`), and the masks' request before the launch."""
        return not self.in_process and self._active is not None and bool(self._active.any())

    def defers_sampler(self, batch: InputBatch) -> bool:
        """Whether the step's sampler should wait for the masks until the runner's next step (DeferredSample),
        so that the grammar process fills them while the engine does its other host work: with a grammar
        process, and not for a step that verifies drafts (the next step needs its tokens at once)."""
        return not self.in_process and not batch.sampled_num_drafts.any()

    def start_step(self, batch: InputBatch, states: RequestStates, constrained: list[int] | None = None) -> list[int]:
        """`start` for the step's constrained rows (returned: their indices into the sampled rows; `constrained`
        where the caller has them already), each with 1 + drafts logits rows, in order. The last step's tokens
        must be on the host."""
        rows = batch.sampled_rows
        if constrained is None:
            constrained = self.constrained(rows, states)
        if constrained:
            counts = 1 + batch.sampled_num_drafts
            self.start(rows, np.cumsum(counts) - counts, batch.sampled_num_drafts, states, constrained)
        return constrained

    def add(self, row: int, states: RequestStates, eos_token_ids: frozenset[int]) -> None:
        """A request under a grammar took `row`. Its matcher is made when the row first samples: the engine core
        has its prompt computed while the grammar compiles (scheduler/sampling_gate.py), and lets it sample only
        once compiled; the compile is started here, for a rank of a multi-process engine that compiles its own."""
        self.compiler.submit(states.sampling_params[row].structured_outputs)
        self._pending[row] = (int(states.row_generation[row]), eos_token_ids)

    def _make_matchers(self, rows: np.ndarray, states: RequestStates) -> None:
        """The matchers of the pending rows among `rows` (a pending row since taken by another request is dropped)."""
        sampling = set(rows.tolist())
        for row in [row for row in self._pending if row in sampling]:
            generation, eos_token_ids = self._pending.pop(row)
            if generation == states.row_generation[row]:
                self._make_matcher(row, states, eos_token_ids)

    def _make_matcher(self, row: int, states: RequestStates, eos_token_ids: frozenset[int]) -> None:
        if self._active is None:
            num_rows = len(states.row_generation)
            self._active = np.zeros(num_rows, dtype=bool)
            self._generation = np.zeros(num_rows, dtype=np.int64)
            self._accepted = np.zeros(num_rows, dtype=np.int64)
        params = states.sampling_params[row].structured_outputs
        if self.grammar_vocab_size is None:
            # xgrammar fills masks this wide (compiled by now, here or in the grammar process, when the engine core
            # waited for it; the rank of a multi-process engine waits here).
            self.compiler.submit(params).result()
            self.grammar_vocab_size = self.compiler.grammar_vocab_size
            self._words = -(-self.grammar_vocab_size // 32)
        # A stop token past the grammar's vocabulary cannot be sampled under it (the mask forbids it).
        stop_tokens = sorted(t for t in eos_token_ids if t < self.grammar_vocab_size)
        if eos_token_ids and not stop_tokens:
            logger.warning("row %d: every stop token (%s) lies past the grammars' %d-token vocabulary: its output "
                           "ends at the grammar's end only through max_tokens", row, sorted(eos_token_ids),
                           self.grammar_vocab_size)
        self._matchers.add(row, params, stop_tokens)
        self._active[row] = True
        self._generation[row] = states.row_generation[row]
        self._accepted[row] = 0

    def constrained(self, rows: np.ndarray, states: RequestStates) -> list[int]:
        """Indices into `rows` of the rows under a grammar (a row reused by another request is dropped); the
        matchers of rows sampling for the first time are made here."""
        if self._pending:
            self._make_matchers(rows, states)
        if self._active is None:
            return []
        active = self._active[rows]
        if not active.any():
            return []
        stale = active & (self._generation[rows] != states.row_generation[rows])
        if stale.any():
            self._active[rows[stale]] = False  # its matcher stays until the row's next grammar replaces it
            active &= ~stale
        return np.flatnonzero(active).tolist()

    def send_tokens(self, rows: np.ndarray, states: RequestStates) -> None:
        """Advance the matchers of `rows` (those under a grammar) through the tokens their requests emitted
        since: as soon as they are on the host, so that a grammar process accepts them meanwhile."""
        if self._active is None:
            return
        moved = self._advance(rows[self._active[rows] & (self._generation[rows] == states.row_generation[rows])],
                              states)
        if moved is not None:
            self._matchers.accept(*moved)

    def send_ready_tokens(self, last: PendingOutput | None, states: RequestStates) -> bool:
        """`send_tokens` for the rows of the last step (`last`) if its tokens are on the host: never waits for
        them. Whether the matchers have them now (also when there was no step, or they had them already)."""
        if last is None or last is self._tokens_from:
            return True
        if not last.has_tokens():
            return False
        last.result()
        self.send_tokens(last.rows, states)
        self._tokens_from = last
        return True

    def start(self, rows: np.ndarray, first_logit_rows: np.ndarray, num_drafts: np.ndarray, states: RequestStates,
              constrained: list[int]) -> None:
        """Begin the masks of row `rows[i]` (i in `constrained`) for its logits rows `first_logit_rows[i]` ..
        `+ num_drafts[i]`: one per draft position (the grammar having accepted the drafts before it), then the
        position after the drafts; with a tree, the root's and then one per node (the grammar having accepted
        the node's path). The rows' tokens must be on the host. `apply` finishes them."""
        chosen = np.asarray(constrained, dtype=np.int64)
        grammar_rows = rows[chosen]
        drafts = np.asarray(num_drafts)[chosen]
        starts = np.asarray(first_logit_rows)[chosen]
        num_masks = len(chosen) + int(drafts.sum())
        num_logit_rows = len(rows) + int(np.asarray(num_drafts).sum())
        # A resumed request's replay, a verifying step's tokens, or any not sent: accepted before the fill.
        moved = self._advance(grammar_rows, states)
        buffer, index, bitmask = self._host_buffer(num_logit_rows, num_masks)
        if not drafts.any():
            index[:] = starts
            draft_tokens = np.zeros(0, dtype=np.int64)
        else:
            first_slot = np.cumsum(drafts + 1) - (drafts + 1)
            index[:] = np.repeat(starts - first_slot, drafts + 1) + np.arange(num_masks)
            lengths = states.num_tokens[grammar_rows]  # the drafts sit after the row's tokens
            draft_tokens = np.concatenate([states.token_ids[row, length : length + count] for row, length, count
                                           in zip(grammar_rows.tolist(), lengths.tolist(), drafts.tolist())])
        empty = self._empty_flags(self._host_numpy[self._turn], num_logit_rows)
        empty[:] = 0
        empty[index] = 1
        self._matchers.fill(self._turn, self._masks_at, bitmask, grammar_rows, drafts, draft_tokens, accept=moved)
        self._started = buffer, num_masks, index, num_logit_rows

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Mask the logits rows of the step `start` began (its masks done first). Returns [logits rows] bool on
        the logits' device: the rows whose mask allowed no token (the kernel's flags, read by the step's sampler
        before the buffer's next fill: that fill needs the step's tokens)."""
        buffer, num_masks, index, num_logit_rows = self._started
        self._started = None
        self._matchers.take()
        return self._apply(logits, buffer, num_masks, index, num_logit_rows)

    @property
    def _masks_at(self) -> int:
        """Where a buffer's masks begin: after the logits rows and the flags (capacity / 4 words: 64-byte aligned)."""
        return self._capacity + self._capacity // 4

    def _empty_flags(self, buffer: np.ndarray | torch.Tensor, num_logit_rows: int) -> np.ndarray | torch.Tensor:
        """A buffer's flag bytes of the step's logits rows (a view: numpy on the host, torch on the device)."""
        flags = buffer[self._capacity : self._masks_at]
        return (flags.view(np.uint8) if isinstance(flags, np.ndarray) else flags.view(torch.uint8))[:num_logit_rows]

    def close(self) -> None:
        self._matchers.close()

    def _advance(self, grammar_rows: np.ndarray, states: RequestStates) -> tuple[np.ndarray, ...] | None:
        """The rows' tokens their matchers have not had (rows, counts, tokens: for `accept`), counted as had;
        None if there are none."""
        start = states.num_prompt_tokens[grammar_rows] + self._accepted[grammar_rows]
        count = states.num_tokens[grammar_rows] - start
        moving = count > 0
        if not moving.any():
            return None
        if not moving.all():
            grammar_rows, start, count = grammar_rows[moving], start[moving], count[moving]
        if (count == 1).all():  # the usual step: one new token per row
            tokens = states.token_ids[grammar_rows, start]
        else:
            tokens = np.concatenate([states.token_ids[row, first : first + n] for row, first, n
                                     in zip(grammar_rows.tolist(), start.tolist(), count.tolist())])
        self._accepted[grammar_rows] += count
        return grammar_rows, count, tokens

    def _host_buffer(self, num_logit_rows: int, num_masks: int) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """This step's host buffer, once the copy from its last use has run, with its numpy views: the masks'
        logits rows (int32) and the masks [num_masks, words]; it holds flags for `num_logit_rows` (>= num_masks).
        xgrammar gets the masks as numpy, whose DLPack device is plain CPU: a pinned tensor's is CUDA-host memory,
        which not every xgrammar release takes."""
        if num_logit_rows > self._capacity:
            self._capacity = -(-max(num_logit_rows, 2 * self._capacity) // 64) * 64
            pinned = self.device.type == "cuda"
            size = self._masks_at + self._capacity * self._words
            # The old buffers are released (a grammar process's shared memory, device memory the copy stream
            # wrote): their copies must have run.
            for event in self._copied:
                if event is not None:
                    event.synchronize()
            self._host, self._host_numpy = [], []  # no view may hold the old mappings open
            self._host = self._matchers.new_buffers(size, pinned)
            self._host_numpy = [buffer.numpy() for buffer in self._host]
            self._copied = [None, None]
            if pinned:
                self._on_device = [torch.empty(size, dtype=torch.int32, device=self.device) for _ in range(2)]
            if pinned and self._copy_events is None:
                self._copy_events = [torch.cuda.Event(), torch.cuda.Event()]
                self._consumed = [torch.cuda.Event(), torch.cuda.Event()]
                self._copy_stream = torch.cuda.Stream(self.device)
        self._turn ^= 1
        if self._copied[self._turn] is not None:
            self._copied[self._turn].synchronize()  # done in practice: it was queued a step before the last
        host = self._host_numpy[self._turn]
        bitmask = host[self._masks_at : self._masks_at + num_masks * self._words]
        return self._host[self._turn], host[:num_masks], bitmask.reshape(num_masks, self._words)

    def _apply(self, logits: torch.Tensor, buffer: torch.Tensor, num_masks: int, host_index: np.ndarray,
               num_logit_rows: int) -> torch.Tensor:
        end = self._masks_at + num_masks * self._words
        if self._on_device:
            # One copy (rows and masks), without blocking the host; the mask kernel waits for it.
            on_device, copied = self._on_device[self._turn], self._copy_events[self._turn]
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(self._consumed[self._turn])
                on_device[:end].copy_(buffer[:end], non_blocking=True)
                copied.record()
            self._copied[self._turn] = copied
            torch.cuda.current_stream(self.device).wait_event(copied)
            buffer = on_device
        empty = self._empty_flags(buffer, num_logit_rows)
        self._mask_logits(logits, buffer, num_masks, host_index, empty)
        if self._on_device:
            self._consumed[self._turn].record()
        return empty.view(torch.bool)

    def _mask_logits(self, logits: torch.Tensor, buffer: torch.Tensor, num_masks: int, host_index: np.ndarray,
                     empty: torch.Tensor) -> None:
        index = buffer[:num_masks]
        bitmask = buffer[self._masks_at : self._masks_at + num_masks * self._words].view(num_masks, self._words)
        if use_triton(logits):
            from tokenmill.kernels.token_bitmask import apply_token_bitmask

            apply_token_bitmask(logits, bitmask, index, self.grammar_vocab_size, empty)
        else:
            forbidden = ~unpack_bitmask(bitmask, logits.shape[-1], self.grammar_vocab_size)
            empty[torch.from_numpy(host_index[~forbidden.all(dim=1).numpy()]).long()] = 0
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
