"""Tensor-parallel group membership. One process and rank 0 until a multi-GPU executor sets it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1


_TP_GROUP = TensorParallelGroup()


def get_tp_rank() -> int:
    return _TP_GROUP.rank


def get_tp_size() -> int:
    return _TP_GROUP.world_size
