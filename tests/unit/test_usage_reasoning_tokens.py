"""usage.completion_tokens_details.reasoning_tokens (server/usage.py, sample/thinking_budget.py's machine): the
output tokens strictly inside reasoning blocks, fed in any pieces, against a plain left-to-right reading."""

from hypothesis import given
from hypothesis import strategies as st

from tokenmill.sample.thinking_budget import ReasoningTokenCount
from tokenmill.server.reasoning_parsers import get_reasoning_parser
from tokenmill.server.usage import ReasoningTokens, Usage

START, END = [7, 8, 9], [5, 8, 9]  # "<think>", "</think>" as a BPE tokenizer splits them: a shared tail
R1, QWEN3 = get_reasoning_parser("deepseek_r1"), get_reasoning_parser("qwen3")


def reference(tokens: list[int], inside: bool) -> int:
    """Markers matched where they begin, reading left to right; the tokens between them counted."""
    count, i = 0, 0
    while i < len(tokens):
        marker = END if inside else START
        if tokens[i:i + len(marker)] == marker:
            inside, i = not inside, i + len(marker)
            continue
        count += inside
        i += 1
    return count


pieces = st.lists(st.sampled_from([[1], [2], [5], [7], [8], [9], START, END, [5, 8], [7, 8]]), max_size=30)


@given(pieces, st.booleans(), st.lists(st.integers(1, 4), min_size=1, max_size=8))
def test_the_count_is_the_tokens_between_the_markers_whatever_the_pieces(parts, inside, cuts):
    tokens = [token for part in parts for token in part]
    count = ReasoningTokenCount.inside(START, END) if inside else ReasoningTokenCount.after_prompt([1], START, END)
    i = 0
    for cut in cuts * len(tokens):  # fed as the steps' tokens come: a few at a time
        if i >= len(tokens):
            break
        count.feed(tokens[i:i + cut])
        i += cut
    assert count.count == reference(tokens, inside)


def test_a_prompt_that_ends_inside_a_block_counts_from_the_first_token():
    opened, closed = [1, *START, 2], [1, *START, 2, *END]
    for parser in (R1, QWEN3):
        counts = ReasoningTokens(opened, (START, END), parser)
        counts.add(0, [1, 2, 3, *END, 4])
        assert counts.total == 3
    counts = ReasoningTokens(closed, (START, END), QWEN3)
    counts.add(0, [1, 2, *END, 4])  # an end marker never opened: content (as the streamed parser takes it)
    assert counts.total == 0


def test_deepseek_r1_takes_an_unopened_output_as_reasoning():
    counts = ReasoningTokens([1, 2], (START, END), R1)
    counts.add(0, [1, 2])
    counts.add(0, [*END, 4, 4])
    counts.add(1, [*START, 1])  # the model opened it itself: its marker is not reasoning
    counts.add(1, [2, 3, *END, 4])
    assert counts.total == 2 + 3


def test_no_parser_for_the_request_counts_nothing_and_usage_reports_it():
    counts = ReasoningTokens([1, *START], (START, END), None)  # thinking turned off for this request
    usage = Usage(4, reasoning=counts)
    usage.add([1, 2, *END])
    assert usage.body() == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9,
                            "completion_tokens_details": {"reasoning_tokens": 0}}
    assert "completion_tokens_details" not in Usage(2).body()
