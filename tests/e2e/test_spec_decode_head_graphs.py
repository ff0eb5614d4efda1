"""EAGLE, EAGLE-3 and MTP heads' draft steps, and EAGLE and EAGLE-3 draft trees' level passes, replayed from CUDA
graphs (GPU, float32, the tiny random targets and heads of the CPU tests): every proposal is made twice from the
same state, once eagerly and once with the head's graphs, and the two draft exactly the same tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.e2e.test_spec_decode import TREE as EAGLE_TREE
from tests.e2e.test_spec_decode import always_draft, check_same_tokens_and_logprobs, eagle_target_and_head, workload  # noqa: F401 (fixture)
from tests.e2e.test_spec_decode_eagle3 import TREE as EAGLE3_TREE
from tests.e2e.test_spec_decode_eagle3 import proposer_of, random_target_and_head  # noqa: F401 (fixture)
from tests.e2e.test_spec_decode_mtp import random_mtp  # noqa: F401 (fixture)
from tokenmill import LLM
from tokenmill.config import parse_token_tree

pytestmark = pytest.mark.gpu

K = 3


RUNNERS = ("cuda_graphs", "tree_graphs", "chain_graphs")


def compare_with_eager(proposer) -> list[tuple[int, int, int, int]]:
    """From now on every proposal runs eagerly first, then again from the same state with the graphs, and
    asserts that both draft the same tokens; returns (draft-step graph replays, draft-tree level graph replays,
    whole-chain graph replays, most drafts of a row) of each proposal that drafted."""
    runners = {name: getattr(proposer, name) for name in RUNNERS if getattr(proposer, name, None) is not None}
    replays = dict.fromkeys(runners, 0)
    for name, runner in runners.items():
        def counting_run(*args, name=name, run=runner.run, **kwargs):
            out = run(*args, **kwargs)
            replays[name] += out is not None
            return out

        runner.run = counting_run
    propose, calls = proposer.propose, []

    def comparing_propose(states, rows, max_drafts):
        if states.has_next_drafts(rows).all():  # drafted right after the last verification: no pass to compare
            return propose(states, rows, max_drafts)
        num_computed = proposer.num_computed.copy()  # all propose() changes besides the head's KV
        for name in runners:
            setattr(proposer, name, None)
        eager = propose(states, rows, max_drafts)
        proposer.num_computed[:] = num_computed
        for name, runner in runners.items():
            setattr(proposer, name, runner)
        before = dict(replays)
        replayed = propose(states, rows, max_drafts)
        assert [d.tolist() for d in replayed] == [d.tolist() for d in eager], (rows, max_drafts)
        steps = max((len(d) for d in replayed), default=0)
        if steps:
            calls.append(tuple(replays.get(name, 0) - before.get(name, 0) for name in RUNNERS) + (steps,))
        return replayed

    draft_after_verify = proposer.draft_after_verify

    def comparing_after_verify(*args):  # drafting right after a verification: the same comparison
        for name in runners:
            setattr(proposer, name, None)
        eager = draft_after_verify(*args)
        for name, runner in runners.items():
            setattr(proposer, name, runner)
        before = dict(replays)
        replayed = draft_after_verify(*args)
        assert replayed.tolist() == eager.tolist()
        calls.append(tuple(replays.get(name, 0) - before.get(name, 0) for name in RUNNERS) + (replayed.shape[1],))
        return replayed

    proposer.propose = comparing_propose
    proposer.draft_after_verify = comparing_after_verify
    return calls


FIXTURES = {"eagle": "eagle_target_and_head", "eagle3": "random_target_and_head", "mtp": "random_mtp"}


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_head_drafts_replayed_from_cuda_graphs_equal_eager_drafts(method, request):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    made = request.getfixturevalue(FIXTURES[method])
    spec = {"method": method, "num_speculative_tokens": K}
    if method != "mtp":
        spec["model"] = made[1]  # the head's folder; MTP's layer is in the target's checkpoint
    # max_num_seqs caps a verifying step's tokens too (Worker.max_verify_tokens): the default's room for every draft
    llm = LLM(made[0].path, skip_tokenizer_init=True, max_model_len=128, dtype="float32", device="cuda",
              kv_cache_space=0.01, speculative_config=spec)
    always_draft(llm)
    proposer = proposer_of(llm)
    assert proposer.cuda_graphs is not None and len(proposer.cuda_graphs.extra_inputs) == 1
    assert proposer.chain_graphs is not None
    calls = compare_with_eager(proposer)
    llm.generate(*workload(), use_tqdm=False)
    assert len(calls) >= 5, calls
    # A chain drafted right after its verification replays one graph, passes and all. A proposal from the host's
    # tokens (a request's first) replays the k - 1 one-token steps' graphs, and the first pass's too when it is one
    # token per row.
    assert all(chains == 1 if chains else replays >= steps - 1 for replays, _, chains, steps in calls), calls
    assert sum(chains for _, _, chains, _ in calls) >= 5, calls


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_draft_trees_replayed_from_cuda_graphs_equal_eager_drafts(method, request):
    """Each level pass of a draft tree replays its level's graph (worker.tree_cuda_graph), whole trees and (every
    other proposal) trees of every size, whose deeper levels have fewer rows."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from tokenmill.spec.tree import TokenTree

    made = request.getfixturevalue(FIXTURES[method])
    tree = {"eagle": EAGLE_TREE, "eagle3": EAGLE3_TREE}[method]
    spec = {"method": method, "model": made[1], "num_speculative_tokens": K, "speculative_token_tree": tree}
    llm = LLM(made[0].path, skip_tokenizer_init=True, max_model_len=128, dtype="float32", device="cuda",
              kv_cache_space=0.01, speculative_config=spec)
    always_draft(llm)
    proposer = proposer_of(llm)
    assert proposer.tree_graphs is not None and set(proposer.tree_graphs.sizes) == {1, 2}
    calls = compare_with_eager(proposer)
    shape = TokenTree.from_paths(parse_token_tree(tree))
    propose = proposer.propose

    def varied_propose(states, rows, max_drafts):  # trees of every size: fewer rows at the deeper levels
        sizes = (np.arange(len(rows)) * 3 + len(calls)) % (shape.num_nodes + 1)
        return propose(states, rows, np.where(len(calls) % 2, np.minimum(max_drafts, sizes), max_drafts))

    proposer.propose = varied_propose
    llm.generate(*workload(), use_tqdm=False)
    assert len(calls) >= 5, calls
    # every level pass fits a graph: one replay per level below the deepest drafted node
    assert all(tree_replays == shape.depth_of(np.array([steps]))[0] - 1 for _, tree_replays, _, steps in calls), calls
    assert sum(tree_replays for _, tree_replays, _, _ in calls) >= 10, calls


def test_one_sequence_at_a_time_drafts_with_cuda_graphs(request):
    """max_num_seqs 1 on the GPU: the verify steps (1 + k tokens, beyond the decode graphs' single row) and the
    head's draft graphs give plain decoding's greedy tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    target, head = request.getfixturevalue("eagle_target_and_head")
    engine = dict(skip_tokenizer_init=True, max_model_len=128, dtype="float32", device="cuda", kv_cache_space=0.01,
                  max_num_seqs=1)
    plain = LLM(target.path, **engine).generate(*workload(), use_tqdm=False)
    llm = LLM(target.path, **engine, speculative_config={"method": "eagle", "model": head, "num_speculative_tokens": K})
    always_draft(llm)
    assert proposer_of(llm).cuda_graphs is not None
    check_same_tokens_and_logprobs(llm.generate(*workload(), use_tqdm=False), plain)
    assert llm.engine.last_stats.spec_decoding.num_accepted_tokens > 0


def test_a_step_time_budget_is_measured_beside_an_eagle_head(request):
    """target_step_ms times prefill steps on the runner before any request, the head observing them: the engine
    still drafts and keeps plain decoding's greedy tokens afterwards."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    target, head = request.getfixturevalue("eagle_target_and_head")
    engine = dict(skip_tokenizer_init=True, max_model_len=128, dtype="float32", device="cuda", kv_cache_space=0.01)
    plain = LLM(target.path, **engine).generate(*workload(), use_tqdm=False)
    llm = LLM(target.path, **engine, target_step_ms=20.0,
              speculative_config={"method": "eagle", "model": head, "num_speculative_tokens": K})
    assert llm.engine.core.scheduler.config.max_num_batched_tokens >= 512
    always_draft(llm)
    check_same_tokens_and_logprobs(llm.generate(*workload(), use_tqdm=False), plain)
    assert llm.engine.last_stats.spec_decoding.num_accepted_tokens > 0
