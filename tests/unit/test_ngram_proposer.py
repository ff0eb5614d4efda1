"""The n-gram proposer: the longest recent suffix match, the tokens that followed it, batched over rows; its
per-request index proposes what a rescan of the whole history does, across rows reused, forked and resumed."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.output import NewRequestData, SchedulerOutput
from tokenmill.spec.ngram import NgramProposer
from tokenmill.worker.request_state import RequestStates
from tokenmill.worker.speculative import SpeculativeDecoding


def rescan(min_n, max_n, token_ids, num_tokens, max_drafts):
    """The proposer before its index (a full rescan per step): the reference its proposals must equal."""
    num_rows = len(num_tokens)
    drafts = [np.empty(0, dtype=np.int64)] * num_rows
    width = int(num_tokens.max()) if num_rows else 0
    if width < 2:
        return drafts
    tokens = token_ids[:, :width]
    last = num_tokens - 1
    ends = np.arange(width)
    matches = (ends[None, :] < last[:, None]) & (max_drafts > 0)[:, None]
    best_end = np.full(num_rows, -1)
    for m in range(1, min(max_n, width - 1) + 1):
        back = last - (m - 1)
        if m > 1:
            matches[:, : m - 1] = False
            wanted = tokens[np.arange(num_rows), np.maximum(back, 0)]
            matches[:, m - 1 :] &= tokens[:, : width - m + 1] == wanted[:, None]
            matches &= (back >= 0)[:, None]
        else:
            matches &= tokens == tokens[np.arange(num_rows), last][:, None]
        if m < min_n:
            continue
        found = matches.any(axis=1)
        if not found.any():
            break
        best_end[found] = width - 1 - np.argmax(matches[found, ::-1], axis=1)
    for row in np.flatnonzero(best_end >= 0).tolist():
        start = best_end[row] + 1
        drafts[row] = tokens[row, start : min(start + max_drafts[row], num_tokens[row])].copy()
    return drafts


def new_request(request_id, token_ids, num_prompt_tokens=None):
    return NewRequestData(request_id, list(token_ids), num_prompt_tokens or len(token_ids), SamplingParams(), [], 0)


def step(states, new=(), finished=()):
    states.apply(SchedulerOutput(list(new), [], {}, 0, set(finished)))


def propose(proposer, sequences, max_drafts):
    states = RequestStates(len(sequences), max(len(s) for s in sequences) + 8, 1)
    step(states, [new_request(str(i), s) for i, s in enumerate(sequences)])
    states.token_ids[:, -8:] = 7  # beyond every row's tokens: never read
    rows = np.array([states.row_of[str(i)] for i in range(len(sequences))])
    return [d.tolist() for d in proposer.propose(states, rows, np.array(max_drafts))]


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


MAX_LEN = 96


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_index_proposes_what_a_rescan_of_the_history_does(data):
    """Requests arrive (some forks of a live one's prompt: n > 1), grow by 1 to 5 tokens a step (the drafts or
    not), finish, or are preempted and resumed with their tokens so far, in a row another request may have had."""
    min_n = data.draw(st.integers(1, 4))
    max_n = data.draw(st.integers(min_n, 5))
    vocab = data.draw(st.integers(2, 5))
    tokens = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=30)
    states = RequestStates(4, MAX_LEN, 1)
    proposer = NgramProposer(min_n, max_n)
    speculative = SpeculativeDecoding(proposer, None, torch.device("cpu"))
    preempted: list[list[int]] = []
    for n in range(data.draw(st.integers(1, 14))):
        live = list(states.row_of)
        gone = data.draw(st.lists(st.sampled_from(live), unique=True)) if live else []
        new = []
        for rid in gone:
            row = states.row_of[rid]
            if data.draw(st.booleans()):  # preempted: resumed later with its tokens so far
                preempted.append(states.token_ids[row, : states.num_tokens[row]].tolist())
        for i in range(data.draw(st.integers(0, 4 - len(live) + len(gone)))):
            choice = data.draw(st.sampled_from(["new", "fork", "resume"]))
            if choice == "resume" and preempted:
                new.append(new_request(f"r{n}.{i}", preempted.pop(), 1))
            elif choice == "fork" and len(live) > len(gone):
                parent = states.row_of[next(rid for rid in live if rid not in gone)]
                new.append(new_request(f"f{n}.{i}", states.token_ids[parent, : states.num_prompt_tokens[parent]]))
            else:
                new.append(new_request(f"n{n}.{i}", data.draw(tokens)))
        if data.draw(st.booleans()):  # else a row given to another request is told apart by its generation
            speculative.drop_finished(set(gone), states)
        step(states, new, gone)
        if not states.row_of:
            continue
        rows = np.array(data.draw(st.lists(st.sampled_from(sorted(states.row_of.values())), min_size=1, unique=True)))
        max_drafts = np.array(data.draw(st.lists(st.integers(0, 4), min_size=len(rows), max_size=len(rows))))
        # Rejected drafts of earlier steps lie past the known tokens.
        for row in rows.tolist():
            states.token_ids[row, states.num_tokens[row] :] = data.draw(st.integers(0, vocab - 1))
        expected = rescan(min_n, max_n, states.token_ids[rows], states.num_tokens[rows], max_drafts)
        got = proposer.propose(states, rows, max_drafts)
        assert [d.tolist() for d in got] == [d.tolist() for d in expected]
        for row, draft in zip(rows.tolist(), got):  # the verification keeps some drafts, then a token of its own
            length = int(states.num_tokens[row])
            kept = list(draft[: data.draw(st.integers(0, len(draft)))]) + [data.draw(st.integers(0, vocab - 1))]
            kept = kept[: MAX_LEN - length]
            states.token_ids[row, length : length + len(kept)] = kept
            states.num_tokens[row] += len(kept)


def test_the_index_goes_with_a_finished_or_preempted_request():
    states = RequestStates(2, 32, 1)
    proposer = NgramProposer(2, 2)
    speculative = SpeculativeDecoding(proposer, None, torch.device("cpu"))
    step(states, [new_request("a", [1, 2, 3, 1, 2]), new_request("b", [5, 6, 5])])
    rows = np.array([states.row_of["a"], states.row_of["b"]])
    assert [d.tolist() for d in proposer.propose(states, rows, np.array([2, 2]))] == [[3, 1], []]
    speculative.drop_finished({"a", "never-scheduled"}, states)
    step(states, finished={"a", "never-scheduled"})
    assert list(proposer._rows) == [states.row_of["b"]]
    # Resumed into the same row with other tokens (a preemption, then the prompt and its output recomputed).
    step(states, [new_request("a", [1, 2, 9, 9, 1, 2], 4)])
    row = states.row_of["a"]
    assert row == rows[0] and proposer.propose(states, np.array([row]), np.array([2]))[0].tolist() == [9, 9]
