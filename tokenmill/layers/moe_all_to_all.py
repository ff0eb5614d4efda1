"""Routed experts spread over every rank of data-parallel replicas: each rank's tokens go to the ranks that hold
their experts and the experts' outputs come back, by all-to-all (torch.distributed, any backend).

Every replica runs its own batch, so its tokens are its own (a replica's tensor-parallel ranks each send a share
of them: layers.moe.FusedMoE); a layer's exchange is four all-to-alls: the assignment counts per destination,
then the assigned rows, their experts' local ids, and back the rows' outputs. Each side learns the other's
counts from the first, so no buffer is padded to a worst case. A step with more tokens than the memory profile's
pass took over all ranks is exchanged in rounds of that many (`tokens_per_step`), so that no rank's experts ever
compute more rows than the profile made room for. Every rank must therefore call every MoE layer
together, in the same order: the engine cores step in lockstep (engine.replica_lockstep), and a replica with
nothing to run calls each layer with no tokens (`ExpertExchange.run` on empty inputs), still computing and
returning the rows the others send it.

The combine rounds as layers.moe_routing.run_experts does (each (token, slot) row scaled by its weight, then
a token's slots summed in slot order), so each row's arithmetic is the one-process engine's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from tokenmill.layers.moe_routing import expert_range

ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(rows [R, H], weights [R, 1], local expert ids [R, 1]) -> each row through its expert, times its weight."""


class ExpertExchange:
    """The dispatch and combine of a layer whose experts `num_ranks` ranks (those of `group`, default the world)
    share out, rank r holding expert_range(num_experts, r, num_ranks)'s."""

    live = False
    """Set once the engine cores step in lockstep; before (memory profiling, warm-up) each rank's layers compute
    only their own experts' assignments."""
    tokens_per_step = 0
    """The step's token budget (max_num_batched_tokens), set with `live` (0: unbounded). One round of a layer's
    exchange carries at most that many tokens over all its ranks, as many as the memory profile's forward pass
    computed, so that a skewed routing (every token to one rank's experts) never has a rank compute more rows than
    that pass's layer did: a step with more tokens takes more rounds, as many on every rank."""

    def __init__(self, num_experts: int, num_ranks: int, group=None) -> None:
        self.num_ranks, self.group = num_ranks, group
        ranges = [expert_range(num_experts, r, num_ranks) for r in range(num_ranks)]
        # On the CPU whatever device the model is built under (meta, for quantized ones); moved at the first run.
        self.first_expert = torch.tensor([first for first, _ in ranges], device="cpu")
        """Per rank: the global id of its first expert (a global id less it is the holder's local id)."""
        self.holder = torch.tensor([r for r, (_, n) in enumerate(ranges) for _ in range(n)], device="cpu")
        """Per global expert id: the rank that holds it."""

    def run(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            experts: ExpertsFn) -> torch.Tensor:
        """hidden [T, H] of this rank's tokens, their routing [T, K] (global ids) -> the layer's output [T, H]."""
        if self.holder.device != topk_ids.device:
            self.holder, self.first_expert = self.holder.to(topk_ids.device), self.first_expert.to(topk_ids.device)
        num_tokens = hidden.shape[0]
        budget = ExpertExchange.tokens_per_step
        per_round = max(1, budget // self.num_ranks if budget else num_tokens)
        outputs, rounds = [], 1
        while len(outputs) < rounds:
            part = slice(len(outputs) * per_round, (len(outputs) + 1) * per_round)  # empty past this rank's tokens
            out, most = self._round(hidden[part], topk_weights[part], topk_ids[part], experts,
                                    0 if outputs else -(-num_tokens // per_round))
            rounds = max(rounds, most)
            outputs.append(out)
        return outputs[0] if rounds == 1 else torch.cat(outputs)

    def _round(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: ExpertsFn,
               rounds_needed: int) -> tuple[torch.Tensor, int]:
        """One round of the exchange on these tokens; `rounds_needed`: this rank's rounds (said in the first
        round, with the counts): returns the output and the most rounds any rank needs."""
        num_tokens, top_k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)
        dest = self.holder[flat_ids]
        order = dest.argsort(stable=True)  # the assignments grouped by destination
        token_of = order // top_k
        send_counts = torch.bincount(dest, minlength=self.num_ranks)
        announce = torch.stack([send_counts, torch.full_like(send_counts, rounds_needed)], dim=1)  # [R, 2]
        heard = torch.empty_like(announce)
        dist.all_to_all_single(heard, announce, group=self.group)
        counts = torch.cat([send_counts, heard.flatten()]).tolist()  # one read-back of both sides' counts
        send_splits, recv_splits = counts[: self.num_ranks], counts[self.num_ranks :: 2]
        rounds = max(counts[self.num_ranks + 1 :: 2])
        received = sum(recv_splits)
        sorted_dest = dest[order]
        local_ids = flat_ids[order] - self.first_expert[sorted_dest]
        rows = self._exchange(hidden.index_select(0, token_of), received, recv_splits, send_splits)
        ids = self._exchange(local_ids, received, recv_splits, send_splits)
        if received:
            done = experts(rows, torch.ones(received, 1, dtype=topk_weights.dtype, device=rows.device), ids[:, None])
        else:
            done = rows
        back = self._exchange(done.to(hidden.dtype), num_tokens * top_k, send_splits, recv_splits)
        slot_out = torch.empty_like(back)
        slot_out[order] = back
        weighted = slot_out * topk_weights.to(hidden.dtype).reshape(-1, 1)
        return weighted.view(num_tokens, top_k, hidden.shape[1]).sum(dim=1), rounds

    def _exchange(self, send: torch.Tensor, num_received: int, recv_splits: list[int],
                  send_splits: list[int]) -> torch.Tensor:
        out = send.new_empty((num_received, *send.shape[1:]))
        dist.all_to_all_single(out, send.contiguous(), recv_splits, send_splits, group=self.group)
        return out
