"""The draft budget: how many drafts a step verifies, from the measured step cost and acceptance rate."""

from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.draft_budget import MAX_PAUSE, DraftBudget, StepCost, can_draft

# Weight-bound up to ~100 tokens, then compute-bound: the shape of a large model's decode step on a GPU.
GPU_LIKE = StepCost(fixed_s=5e-3, per_token_s=5e-5)


def budget_with_rate(rate: float, **kwargs) -> DraftBudget:
    budget = DraftBudget(4, GPU_LIKE, **kwargs)
    budget.record(10_000, int(10_000 * rate))
    return budget


def test_small_batches_draft_deep_and_large_batches_not_at_all():
    budget = budget_with_rate(0.8)
    assert budget.acceptance_rate > 0.75
    assert budget.drafts_per_request(1) == 4
    assert 0 < budget.drafts_per_request(64) < 4
    assert budget.drafts_per_request(1024) == 0


def test_low_acceptance_drafts_nothing():
    assert budget_with_rate(0.02).drafts_per_request(1) == 0


def test_the_verify_step_stays_within_its_token_limit_and_the_batch_size_switch():
    assert budget_with_rate(0.9, max_tokens_per_step=8).drafts_per_request(4) == 1
    assert budget_with_rate(0.9, max_tokens_per_step=8).drafts_per_request(8) == 0
    assert budget_with_rate(0.9, disable_by_batch_size=3).drafts_per_request(4) == 0
    assert DraftBudget(3, cost=None).drafts_per_request(2) == 3


def test_a_tree_is_given_its_nodes_down_to_the_chosen_depth_and_costs_them():
    sizes = (3, 4, 2, 1)  # nodes per level: 3, 7, 9, 10 down to depths 1..4
    assert [DraftBudget(4, None, tree_level_sizes=sizes).num_slots(d) for d in range(6)] == [0, 3, 7, 9, 10, 10]
    assert DraftBudget(4, None).num_slots(3) == 3  # a chain: its depth
    # 1 + nodes per request within the step's tokens: depth 2 (8 tokens) fits 8, depth 3 (10) does not.
    assert DraftBudget(4, None, max_tokens_per_step=8, tree_level_sizes=sizes).drafts_per_request(1) == 2
    # The measured cost counts every node: at a batch where a chain of 4 pays, the wide tree goes less deep.
    chain, tree = budget_with_rate(0.8), budget_with_rate(0.8, tree_level_sizes=(8, 8, 8, 8))
    assert tree.drafts_per_request(16) < chain.drafts_per_request(16)


def test_steps_that_gain_nothing_pause_lookahead_longer_each_time():
    budget = DraftBudget(2, cost=None)
    pauses = []
    for _ in range(9):
        budget.record_step(num_requests=4, num_accepted=0)  # lookahead given, nothing accepted
        pauses.append(0)
        while budget.drafts_per_request(4) == 0:
            pauses[-1] += 1
    assert pauses == [1, 2, 4, 8, 16, 32, 64, 64, 64][: len(pauses)] and max(pauses) == MAX_PAUSE
    budget.record_step(num_requests=4, num_accepted=3)  # a good step: the next bad one pauses briefly again
    budget.record_step(num_requests=4, num_accepted=0)
    assert budget.drafts_per_request(4) == 0 and budget.drafts_per_request(4) == 2


def test_requests_whose_distribution_depends_on_earlier_positions_never_draft():
    assert can_draft(SamplingParams(temperature=0.7))
    assert not can_draft(SamplingParams(presence_penalty=0.5))
    assert not can_draft(SamplingParams(temperature=0.7, seed=3))
    assert can_draft(SamplingParams(temperature=0, seed=3))  # greedy: the seed draws nothing
