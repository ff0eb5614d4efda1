"""EAGLE, EAGLE-3 and MTP heads' draft steps replayed from CUDA graphs (GPU, float32, the tiny random targets
and heads of the CPU tests): every proposal is made twice from the same state, once eagerly and once with the
head's graphs, and the two draft exactly the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_spec_decode import always_draft, eagle_target_and_head, workload  # noqa: F401 (fixture)
from tests.e2e.test_spec_decode_eagle3 import proposer_of, random_target_and_head  # noqa: F401 (fixture)
from tests.e2e.test_spec_decode_mtp import random_mtp  # noqa: F401 (fixture)
from tokenmill import LLM

pytestmark = pytest.mark.gpu

K = 3


def compare_with_eager(proposer) -> list[tuple[int, int]]:
    """From now on every proposal runs eagerly first, then again from the same state with the graphs, and
    asserts that both draft the same tokens; returns (graph replays, steps) of each proposal that drafted."""
    graphs = proposer.cuda_graphs
    replays = [0]
    run = graphs.run

    def counting_run(*args):
        out = run(*args)
        replays[0] += out is not None
        return out

    graphs.run = counting_run
    propose, calls = proposer.propose, []

    def comparing_propose(states, rows, max_drafts):
        num_computed = proposer.num_computed.copy()  # all propose() changes besides the head's KV
        proposer.cuda_graphs = None
        eager = propose(states, rows, max_drafts)
        proposer.num_computed[:] = num_computed
        proposer.cuda_graphs = graphs
        before = replays[0]
        replayed = propose(states, rows, max_drafts)
        assert [d.tolist() for d in replayed] == [d.tolist() for d in eager], (rows, max_drafts)
        steps = max((len(d) for d in replayed), default=0)
        if steps:
            calls.append((replays[0] - before, steps))
        return replayed

    proposer.propose = comparing_propose
    return calls


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_head_drafts_replayed_from_cuda_graphs_equal_eager_drafts(method, request):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    fixture = {"eagle": "eagle_target_and_head", "eagle3": "random_target_and_head", "mtp": "random_mtp"}[method]
    made = request.getfixturevalue(fixture)
    spec = {"method": method, "num_speculative_tokens": K}
    if method != "mtp":
        spec["model"] = made[1]  # the head's folder; MTP's layer is in the target's checkpoint
    # max_num_seqs caps a verifying step's tokens too (Worker.max_verify_tokens): the default's room for every draft
    llm = LLM(made[0].path, skip_tokenizer_init=True, max_model_len=128, dtype="float32", device="cuda",
              kv_cache_space=0.01, speculative_config=spec)
    always_draft(llm)
    proposer = proposer_of(llm)
    assert proposer.cuda_graphs is not None and len(proposer.cuda_graphs.extra_inputs) == 1
    calls = compare_with_eager(proposer)
    llm.generate(*workload(), use_tqdm=False)
    assert len(calls) >= 5, calls
    # The k - 1 one-token steps replay graphs every time, and the first pass too when it is one token per row:
    # after a step that accepted nothing, which with the random heads is most steps (the EAGLE-1 head here,
    # built from the target's own layer, has most drafts accepted: its first pass is rarely one token).
    assert all(replays >= steps - 1 for replays, steps in calls), calls
    if method != "eagle":
        assert any(replays == steps for replays, steps in calls), calls
