"""How many threads torch computes with on the CPU: all cores but one, unless the user chose.

torch's intra-op (OpenMP) threads spin while they wait for each other, so one busy core slows every
step down to that core's pace: with the frontend process (HTTP, tokenizing, detokenizing) or anything
else running, a step on all cores takes several times longer than on one fewer. Measured on 2 cores
(BENCHMARKS.md, CPU section): 2.1-2.9x faster with one thread while another process is busy. The cost
is an idle machine's batched throughput (0.71x on 2 cores with a batch of 16); the more cores, the
smaller it is. OMP_NUM_THREADS, or a torch.set_num_threads() below the core count, is left alone.

Re-measured for issue 23 with the CPU's fast paths (C attention kernel, prepacked oneDNN GEMMs), same
machine: on an idle machine both cores give 1.6x at batch 64, but with one core busy they give 0.25x
(51 against 204 output tok/s), so the choice stands. vLLM-CPU chooses alike: it reserves a core and binds
its one compute thread to the other. No core binding here (not measured yet): an unbound thread can be
moved off a core that something else takes, a bound one has to share it.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


def leave_a_core_free(num_ranks: int = 1) -> None:
    """`num_ranks` tensor-parallel processes share the cores left: each takes its part (at least one)."""
    num_cpus = len(os.sched_getaffinity(0))
    if "OMP_NUM_THREADS" in os.environ or num_cpus < 2 or torch.get_num_threads() < num_cpus:
        return
    num_threads = max(1, (num_cpus - 1) // num_ranks)
    torch.set_num_threads(num_threads)
    logger.info("CPU: torch computes with %d threads of %d cores, one left for the rest (OMP_NUM_THREADS "
                "overrides)", num_threads, num_cpus)
