"""Pipeline parallelism's transfers: the residual stream from stage to stage, and the sampled tokens from
the last stage to every rank.

A stage hands the next one its (hidden_states, residual) pair as one [2, num_tokens, hidden_size] tensor,
from each tensor-parallel rank to its counterpart (after a row-parallel all-reduce every rank of a stage
holds the whole pair). The receiver knows the shape: every rank builds the same batch from the same
SchedulerOutput.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tokenmill.distributed.parallel_state import get_pp_stage


def send_to_next_stage(hidden_states: torch.Tensor, residual: torch.Tensor) -> None:
    stage = get_pp_stage()
    dist.send(torch.stack([hidden_states, residual]), stage.peer(stage.stage + 1))


def receive_from_previous_stage(num_tokens: int, hidden_size: int, dtype: torch.dtype,
                                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden_states, residual), each [num_tokens, hidden_size], as the previous stage's layers left them."""
    stage = get_pp_stage()
    pair = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)
    dist.recv(pair, stage.peer(stage.stage - 1))
    return pair[0], pair[1]


def broadcast_from_driver(tensor: torch.Tensor) -> torch.Tensor:
    """The driver's `tensor` on every rank of its engine, in place (every rank calls it, same shape). The driver:
    tensor-parallel rank 0 of the last stage (parallel_state's layout), the one that samples for the engine."""
    stage = get_pp_stage()
    dist.broadcast(tensor, stage.driver, group=stage.group)
    return tensor


def start_broadcast_from_driver(tensor: torch.Tensor) -> dist.Work:
    """broadcast_from_driver, returning at once; `tensor` holds the driver's values after wait() (on the host
    under gloo, which receives in a background thread; NCCL's wait() only orders the device's stream)."""
    stage = get_pp_stage()
    return dist.broadcast(tensor, stage.driver, group=stage.group, async_op=True)
