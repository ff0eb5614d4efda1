"""A verifying step launched before the last one's tokens reach the host.

After a step that verified drafts, the next one's positions depend on how many of them stood, which the host
learns only when that step's tokens arrive; the device already knows. The scheduler counts every draft of a
step in flight as accepted (upper bounds), and the drafts for the next step wait on the device
(spec/eagle.py draft_after_verify). So when every request of the next step is a verifying row of that kind,
it is laid out where all the drafts would have stood and moved back on the device by each row's rejected
count: its positions, and its attention's lengths and KV slots (AttentionBackend.place_decodes); its first
input token is the last one emitted, read on the device. The host settles the counts when the tokens come
(worker/pending_output.py): no wait between the steps, and the GPU does not idle while the host prepares.

Rows that need the last step's tokens on the host take the usual path: grammars, penalties and the sampling
options that a host pass reads (seeds, bans, min_tokens, logit bias, processors), and prompt logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.device_copy import to_device
from tokenmill.scheduler.output import SchedulerOutput
from tokenmill.worker.pending_output import PendingOutput
from tokenmill.worker.request_state import RequestStates, index_among


@dataclass
class VerifyAhead:
    """The next step's requests (batch order) as rows of the verifying step in flight (`last`)."""

    last: PendingOutput
    index: np.ndarray
    """[num_reqs] each request's index in `last`'s sampled rows."""
    drafts_index: np.ndarray
    """[num_reqs] each request's row in `last`'s next drafts."""
    num_drafts: np.ndarray
    """[num_reqs] the drafts each request verifies in the next step."""

    @property
    def num_ahead(self) -> np.ndarray:
        """[num_reqs] the drafts `last` verifies for each request, which the host counts as accepted."""
        return self.last.verified.num_drafts[self.index]

    def last_emitted(self) -> torch.Tensor:
        """[len(last's rows)] each row's last token emitted by `last`, on the device."""
        verified = self.last.verified
        return verified.token_ids.gather(1, (verified.num_emitted - 1).unsqueeze(1)).squeeze(1)

    def rejected(self) -> torch.Tensor:
        """[num_reqs] the drafts of `last` each request's row rejected, on the device: how far its positions move
        back from where the host laid them."""
        verified = self.last.verified
        # Pinned (to_device): a copy from pageable memory would first wait for the device to finish the last step.
        index, num_ahead = to_device(np.stack([self.index, self.num_ahead]), verified.num_emitted.device)
        return 1 + num_ahead - verified.num_emitted[index]


def verify_ahead(scheduler_output: SchedulerOutput, states: RequestStates, last: PendingOutput | None,
                 needs_host_pass: np.ndarray) -> VerifyAhead | None:
    """The next step as rows of `last`, if it can launch before `last`'s tokens are on the host (see above);
    `needs_host_pass` [max_num_reqs] bool: the rows whose sampling reads the host's tokens."""
    if last is None or last.is_done or last.verified is None or last.next_drafts is None:
        return None
    if scheduler_output.new_requests or not scheduler_output.num_lookahead_tokens:
        return None
    lookahead = scheduler_output.num_lookahead_tokens
    request_ids = list(scheduler_output.num_scheduled_tokens)
    if len(lookahead) != len(request_ids):
        return None
    num_drafts = np.fromiter((lookahead[r] for r in request_ids), dtype=np.int64, count=len(request_ids))
    num_scheduled = np.fromiter(scheduler_output.num_scheduled_tokens.values(), dtype=np.int64,
                                count=len(request_ids))
    rows = np.fromiter((states.row_of[r] for r in request_ids), dtype=np.int64, count=len(request_ids))
    drafted_index, drafts = last.next_drafts
    if (num_scheduled != 1 + num_drafts).any() or (num_drafts > drafts.shape[1]).any():
        return None
    # Each request's row in the last step (the same request: a row's generation changes when it is given anew).
    kept = np.flatnonzero(last.generations == states.row_generation[last.rows])
    index = index_among(rows, last.rows[kept], len(states.num_tokens))
    if (index < 0).any():
        return None
    index = kept[index]
    drafts_index = index_among(index, drafted_index, len(last.rows))
    if (drafts_index < 0).any() or needs_host_pass[rows].any():
        return None
    for row in rows.tolist():
        params = states.sampling_params[row]
        if params.structured_outputs is not None or params.has_penalties or params.prompt_logprobs is not None:
            return None
    return VerifyAhead(last, index, drafts_index, num_drafts)
