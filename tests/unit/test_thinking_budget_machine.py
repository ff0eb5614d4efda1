"""thinking_token_budget's machine (sample/thinking_budget.py): the host's scan and the device's step agree, token
by token, and the logits of a row whose budget is spent keep only the end marker's next token."""

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tokenmill.sample.thinking_budget import (
    END_MATCHED,
    FORCING,
    LEFT,
    OUTSIDE,
    PHASE,
    THINKING,
    ThinkingBudgets,
    scan,
    step,
)

START, END = [7, 8, 9], [5, 8, 9]  # "<think>", "</think>" as a BPE tokenizer splits them: a shared tail
VOCAB = 12


def generate(prompt: list[int], budget: int, free: list[int]) -> list[int]:
    """The output of a row that would write `free` (one token a step), its end marker forced once the budget is
    spent, by the host's machine."""
    state = scan(prompt, len(prompt), budget, START, END)
    out = []
    for token in free:
        if state[PHASE] == FORCING:
            token = END[state[END_MATCHED]]
        out.append(token)
        step(state, token, START, END)
    return out


def test_the_end_marker_comes_after_the_budget():
    prompt = [1, 2, *START]  # the template opened the block (DeepSeek-R1's)
    assert generate(prompt, 3, [1, 2, 3, 4, 4, 4, 4, 4]) == [1, 2, 3, *END, 4, 4]
    assert generate(prompt, 0, [1, 2, 3, 4]) == [*END, 4]
    # The model's own end marker stops the count: no forcing after it.
    assert generate(prompt, 4, [1, *END, 2, 3, 4, 4, 4]) == [1, *END, 2, 3, 4, 4, 4]


def test_a_block_the_output_opens_counts_from_its_start_marker_and_the_budget_is_the_outputs():
    free = [1, *START, 2, 3, 4, 4, 4, 4, 6, *START, 1, 1, 1, 1]
    # Three tokens inside the first block, then forced; the second block has nothing left: its end forced at once.
    assert generate([1, 2], 3, free) == [1, *START, 2, 3, 4, *END, 6, *START, *END, 1]


def test_a_prompt_whose_block_is_closed_starts_outside():
    closed = [1, *START, 2, *END, 3]  # the template closed it (thinking turned off)
    assert scan(closed, len(closed), 2, START, END)[PHASE] == OUTSIDE
    assert generate(closed, 2, [1, 2, 3, 4, 5]) == [1, 2, 3, 4, 5]
    # Prompt tokens do not spend the budget; a partly written end marker is finished when it is forced.
    opened = [*START, 1, 2, 3, 4, 5]
    assert scan(opened, len(opened), 2, START, END)[LEFT] == 2
    assert generate(opened, 2, [1, 5, 8, 1, 1]) == [1, 5, 8, 9, 1]


def test_a_resumed_requests_state_counts_its_output():
    prompt = [*START, 1]
    output = generate(prompt, 3, [2, 2, 2, 2, 2, 2])
    for done in range(len(output) + 1):
        resumed = scan(prompt + output[:done], len(prompt), 3, START, END)
        state = scan(prompt, len(prompt), 3, START, END)
        for token in output[:done]:
            step(state, token, START, END)
        assert resumed == state


# Streams of single tokens and whole markers (so that blocks open and close often).
tokens = st.lists(st.sampled_from([[1], [5], [7], [8], [9], START, END]), max_size=15).map(
    lambda parts: [t for part in parts for t in part])


@settings(max_examples=200, deadline=None)
@given(prompt=tokens, budget=st.integers(0, 6))
def test_the_prompts_fast_scan_is_the_full_scan(prompt, budget):
    # Markers with no token in common take the fast path (the prompt read from its last end marker on).
    start, end = [7, 8], [5, 9]
    full = [OUTSIDE, budget, 0, 0]
    for token in prompt:
        step(full, token, start, end, counting=False)
    if full[PHASE] == THINKING and full[LEFT] <= 0:
        full[PHASE] = FORCING
    assert scan(prompt, len(prompt), budget, start, end) == full


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(tokens, min_size=1, max_size=5), outputs=st.lists(tokens, min_size=5, max_size=5),
       budgets=st.lists(st.one_of(st.none(), st.integers(0, 5)), min_size=5, max_size=5))
# Blocks the model closes itself, opens, and has closed by the template; a row without a budget beside them.
@example(prompts=[START, [1], [1, *START], START, [1]], budgets=[5, 2, 1, 0, None],
         outputs=[[1, *END, 2, *START, 3, 3, 3, 3, 3], [*START, 1, 1, 1, 1, 1], [5, 8, 1, 1], [1, 1, 1, 1], [1, *END]])
def test_the_devices_machine_is_the_hosts(device, prompts, outputs, budgets):
    """Rows stepped together on the device (some without a budget, in a shuffled batch order) give the tokens and
    states the host's machine gives each alone."""
    machines = ThinkingBudgets(8, torch.device(device))
    rows = np.array([6, 1, 3, 0, 5][: len(prompts)])
    host = {}
    for row, prompt, budget in zip(rows.tolist(), prompts, budgets):
        prompt = prompt or [1]
        machines.add(row, budget, START, END, prompt, len(prompt))
        host[row] = None if budget is None else scan(prompt, len(prompt), budget, START, END)
    for i in range(40):
        logits = torch.randn(len(rows), VOCAB, device=device)
        before = logits.clone()
        machines.force(logits, rows)
        sampled = []
        for j, row in enumerate(rows.tolist()):
            wanted = outputs[j][i] if i < len(outputs[j]) else 1
            state = host[row]
            if state is not None and state[PHASE] == FORCING:
                forced = END[state[END_MATCHED]]
                assert torch.isinf(logits[j]).sum() == VOCAB - 1 and logits[j, forced] == before[j, forced]
                wanted = forced
            else:
                assert torch.equal(logits[j], before[j])
            sampled.append(wanted)
            if state is not None:
                step(state, wanted, START, END)
        machines.advance(rows, torch.tensor(sampled, device=device))
        for row in rows.tolist():
            if host[row] is not None:
                assert machines._states[row].tolist() == host[row], (i, row)


def test_rows_that_verify_drafts_are_found_at_their_last_logits_row():
    budgets = ThinkingBudgets(4, torch.device("cpu"))
    budgets.add(2, 0, START, END, [*START], 3)  # spent: forcing at once
    logits = torch.zeros(4, VOCAB)
    # rows [0, 2]: row 0 verifies two drafts (logits rows 0-2), row 2 samples at logits row 3.
    budgets.force(logits, np.array([0, 2]), np.array([2, 3]))
    assert not torch.isinf(logits[:3]).any()
    assert torch.isinf(logits[3]).sum() == VOCAB - 1 and logits[3, END[0]] == 0


def test_a_forced_token_a_mask_took_still_comes_out():
    budgets = ThinkingBudgets(1, torch.device("cpu"))
    budgets.add(0, 0, START, END, [*START], 3)
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, 3] = 1.0
    budgets.force(logits, np.array([0]))
    assert logits[0].argmax() == END[0] and torch.isinf(logits[0]).sum() == VOCAB - 1


@pytest.mark.parametrize("budget", [-2, 1.5, "4"])
def test_bad_machinesare_refused(budget):
    from tokenmill import SamplingParams

    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=budget)
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None
