"""The benchmark oracle (benchmarks/spec_oracle.py): it drafts from the sequence learnt last that begins with a
row's tokens, and follow_target() learns the target's continuation of a speculative run's own context
(each run's own output).

A toy target stands in for bfloat16's rounding: its greedy token is a hash of the context, except that at a
few context lengths a row of a multi-row (verify) step takes the other side of a "near-tie". The speculative
run below does what the engine does with drafts: one step checks the drafts row by row, keeps the accepted
ones and the target's token at the first mismatch, and a step without drafts is a one-row decode step."""

import numpy as np

from benchmarks.spec_oracle import OracleProposer, follow_target
from tokenmill.worker.request_state import RequestStates

VOCAB, PROMPT, NUM_OUT, K = 50, [3, 1, 4, 1, 5], 60, 4


def plain_next(context: list[int]) -> int:
    return sum((i + 1) * t for i, t in enumerate(context)) * 7919 % VOCAB


def verify_next(context: list[int], flips: set[int]) -> int:
    return (plain_next(context) + 1) % VOCAB if len(context) in flips else plain_next(context)


def plain_run(context: list[int], count: int) -> list[int]:
    sequence = list(context)
    for _ in range(count):
        sequence.append(plain_next(sequence))
    return sequence[len(context):]


def states_of(*sequences: list[int]) -> RequestStates:
    states = RequestStates(max_num_reqs=4, max_model_len=128, max_blocks_per_req=8)
    for row, sequence in enumerate(sequences):
        states.token_ids[row, : len(sequence)] = sequence
        states.num_tokens[row] = len(sequence)
    return states


def speculative_run(oracle: OracleProposer, flips: set[int]) -> list[int]:
    sequence, end = list(PROMPT), len(PROMPT) + NUM_OUT
    while len(sequence) < end:
        [drafts] = oracle.propose(states_of(sequence), np.array([0]), np.array([min(K, end - len(sequence) - 1)]))
        for i in range(len(drafts) + 1):
            token = verify_next(sequence, flips) if len(drafts) else plain_next(sequence)
            sequence.append(token)
            if i == len(drafts) or token != drafts[i]:
                break
    return sequence[len(PROMPT):]


def test_the_oracle_drafts_from_the_sequence_learnt_last_that_begins_with_the_rows_tokens():
    old, new = [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 8, 7]
    oracle = OracleProposer([old])
    oracle.learn(new)
    drafts = oracle.propose(states_of([1, 2], [1, 2, 3, 4], [5], [1, 2, 3, 9, 8, 7]), np.arange(4),
                            np.array([3, 5, 2, 2]))
    assert [d.tolist() for d in drafts] == [[3, 9, 8], [5, 6], [], []]
    assert oracle.misses == 1  # [5]: no known sequence; the last row is at a known sequence's end
    assert oracle.known_prefix([1, 2, 3, 9, 0]) == 4 and oracle.known_prefix([1, 2, 3, 4, 5, 6]) == 6


def test_following_learns_each_divergence_and_the_last_run_is_drafted_throughout():
    flips = {len(PROMPT) + 17, len(PROMPT) + 38}
    oracle = OracleProposer([PROMPT + plain_run(PROMPT, NUM_OUT)])
    followed = follow_target(oracle, lambda: speculative_run(oracle, flips), PROMPT, max_rounds=6)
    assert followed.converged and followed.divergences == [17, 38]
    # Every token is the target's under the verify step's rounding: the flips included.
    assert followed.output == plain_run_with(flips) != plain_run(PROMPT, NUM_OUT)
    oracle.misses = 0
    assert speculative_run(oracle, flips) == followed.output and oracle.misses == 0
    assert oracle.known_prefix(PROMPT + followed.output) == len(PROMPT) + NUM_OUT


def plain_run_with(flips: set[int]) -> list[int]:
    sequence = list(PROMPT)
    while len(sequence) < len(PROMPT) + NUM_OUT:
        sequence.append(verify_next(sequence, flips))
    return sequence[len(PROMPT):]


def test_without_divergences_one_run_suffices_and_rounds_are_capped():
    oracle = OracleProposer([PROMPT + plain_run(PROMPT, NUM_OUT)])
    followed = follow_target(oracle, lambda: speculative_run(oracle, set()), PROMPT, max_rounds=6)
    assert followed.converged and followed.divergences == [] and len(oracle.sequences) == 1
    flips = {len(PROMPT) + 10, len(PROMPT) + 20, len(PROMPT) + 30}
    oracle = OracleProposer([PROMPT + plain_run(PROMPT, NUM_OUT)])
    followed = follow_target(oracle, lambda: speculative_run(oracle, flips), PROMPT, max_rounds=2)
    assert not followed.converged and followed.divergences == [10, 20] and len(oracle.sequences) == 3
