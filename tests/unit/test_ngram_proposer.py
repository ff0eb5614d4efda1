"""The n-gram proposer: the longest recent suffix match, the tokens that followed it, batched over rows."""

import numpy as np

from tokenmill.spec.ngram import NgramProposer


def propose(proposer, sequences, max_drafts):
    width = max(len(s) for s in sequences)
    tokens = np.zeros((len(sequences), width + 3), dtype=np.int64)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = s
    lengths = np.array([len(s) for s in sequences])
    return [d.tolist() for d in proposer.propose(tokens, lengths, np.array(max_drafts))]


def test_the_longest_suffix_wins_and_its_most_recent_occurrence():
    proposer = NgramProposer(1, 3)
    # Suffix [1, 2, 3] occurred at 0 (followed by 9, 9) and at 6 (followed by 4, 5): the latest wins.
    # The 1-gram [3] also occurred after 8, but the longer match is preferred.
    seq = [1, 2, 3, 9, 9, 8, 1, 2, 3, 4, 5, 8, 3, 7, 1, 2, 3]
    assert propose(proposer, [seq], [2]) == [[4, 5]]
    assert propose(proposer, [seq], [5]) == [[4, 5, 8, 3, 7]]


def test_drafts_stop_at_the_known_tokens_and_the_limit():
    proposer = NgramProposer(2, 2)
    assert propose(proposer, [[5, 6, 7, 5, 6]], [4]) == [[7, 5, 6]]  # then the sequence ends
    assert propose(proposer, [[5, 6, 7, 5, 6]], [1]) == [[7]]
    assert propose(proposer, [[5, 6, 7, 5, 6]], [0]) == [[]]


def test_no_match_and_short_sequences_give_no_drafts_per_row():
    proposer = NgramProposer(2, 4)
    rows = [[1, 2, 3, 4], [8], [4, 4, 4], [1, 2, 1, 2, 9, 1, 2]]
    # Row 2: [4, 4] matches at 0 (followed by a 4); row 3: [1, 2] latest earlier match at 2, then 9.
    assert propose(proposer, rows, [3, 3, 3, 3]) == [[], [], [4], [9, 1, 2]]


def test_min_n_is_respected():
    assert propose(NgramProposer(3, 3), [[1, 2, 9, 2]], [2]) == [[]]
    assert propose(NgramProposer(1, 3), [[1, 2, 9, 2]], [2]) == [[9, 2]]


def test_sequences_shorter_than_the_longest_suffix_give_no_drafts():
    # The default lookup is 5 tokens; a 3-token sequence (a 1-token prompt and 2 outputs) crashed the engine.
    assert propose(NgramProposer(5, 5), [[7, 7, 7]], [3]) == [[]]
    assert propose(NgramProposer(2, 5), [[7, 7, 7], [1]], [3, 3]) == [[7], []]
    for length in range(2, 9):  # the longest match ends just before the last token: one draft
        assert propose(NgramProposer(5, 7), [[4] * length], [2]) == [[4] if length > 5 else []]
