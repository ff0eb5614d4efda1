"""IncrementalDetokenizer on a real byte-level BPE tokenizer (SmolLM2's), and find_stop_string."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.engine.detokenizer import IncrementalDetokenizer, StreamDetokenizer, find_stop_string, make_detokenizer

DETOKENIZERS = {
    "python": IncrementalDetokenizer,
    "stream": lambda tok, prompt, skip_special_tokens: StreamDetokenizer(tok._tokenizer, prompt, skip_special_tokens),
}

# Accents, CJK, emoji and a ZWJ sequence: byte-level BPE cuts many of these inside a character.
MULTIBYTE = "Café naïve 日本語のテキスト 🚀🔥 👩\u200d👩\u200d👧 ∑∫ Ελληνικά, done."


@pytest.fixture(params=list(DETOKENIZERS))
def make(request):
    return DETOKENIZERS[request.param]


def feed(detokenizer, token_ids: list[int], chunk: int = 1) -> list[str]:
    return [detokenizer.update(token_ids[i : i + chunk]) for i in range(0, len(token_ids), chunk)]


def test_the_text_really_splits_characters_across_tokens(smollm2_tokenizer):
    # Precondition of the tests below: decoding some tokens alone gives half a character.
    ids = smollm2_tokenizer.encode(MULTIBYTE)
    assert sum("\ufffd" in smollm2_tokenizer.decode([t]) for t in ids) >= 10


@pytest.mark.parametrize("prompt", ["", "Translate this:"])
def test_one_token_at_a_time_never_emits_half_a_character(smollm2_tokenizer, make, prompt):
    tok = smollm2_tokenizer
    prompt_ids, ids = tok.encode(prompt), tok.encode(MULTIBYTE)
    deltas = feed(make(tok, prompt_ids, skip_special_tokens=True), ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == MULTIBYTE
    # No lag either: after each token, the text of every token up to the last one that ends on a
    # character boundary is out.
    for i in range(1, len(ids) + 1):
        last_whole = max(j for j in range(i + 1) if not tok.decode(ids[:j]).endswith("\ufffd"))
        assert "".join(deltas[:i]) == tok.decode(ids[:last_whole])


@pytest.mark.parametrize("chunk", [2, 3, 7])
def test_several_tokens_per_step_give_the_same_text(smollm2_tokenizer, make, chunk):
    tok = smollm2_tokenizer
    ids = tok.encode(MULTIBYTE)
    deltas = feed(make(tok, tok.encode("Hi"), skip_special_tokens=True), ids, chunk)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE


def test_output_continues_the_prompt_text(smollm2_tokenizer, make):
    # The prompt ends mid-word; the output's first token must join it without an extra space.
    tok = smollm2_tokenizer
    ids = tok.encode("The capital of France is Paris, a city of lights.")
    prompt_ids, output_ids = ids[:6], ids[6:]
    deltas = feed(make(tok, prompt_ids, skip_special_tokens=True), output_ids)
    assert tok.decode(prompt_ids) + "".join(deltas) == tok.decode(ids)


def test_a_character_the_prompt_began_is_the_outputs_text(smollm2_tokenizer):
    """A prompt cut inside a character (a continuation fed back as token ids): the character its output completes
    was dropped from the text. An orphan byte's U+FFFD stays the prompt's."""
    tok = smollm2_tokenizer
    ids = tok.encode("Dog: 🐶🐱 ok")
    for k in range(1, len(ids)):
        text = "".join(feed(make_detokenizer(tok, ids[:k], skip_special_tokens=True), ids[k:]))
        assert tok.decode(ids[:k]).rstrip("\ufffd") + text == tok.decode(ids), k
    cut = next(k for k in range(len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    assert "".join(feed(make_detokenizer(tok, ids[:cut], True), tok.encode(" ok"))) == " ok"


@pytest.mark.parametrize("skip, expected", [(True, " bye"), (False, " bye<|im_end|>")])
def test_special_tokens_follow_skip_special_tokens(smollm2_tokenizer, make, skip, expected):
    tok = smollm2_tokenizer
    ids = tok.encode(" bye") + [tok.eos_token_id]
    assert "".join(feed(make(tok, tok.encode("Say"), skip_special_tokens=skip), ids)) == expected



@pytest.mark.parametrize("python", [False, True], ids=["stream", "python"])
def test_kept_special_tokens_show_and_the_others_stay_skipped(smollm2_tokenizer, python):
    tok = smollm2_tokenizer
    keep, prompt = tok.convert_tokens_to_ids("<|im_start|>"), [*tok.encode("Say"), tok.eos_token_id]
    ids = [*tok.encode(" so"), keep, *tok.encode(" ok"), tok.eos_token_id]
    detokenizer = make_detokenizer(tok, prompt, True, keep_special_token_ids=[keep])
    assert isinstance(detokenizer, StreamDetokenizer) and tok.eos_token_id in detokenizer.dropped_ids
    if python:
        detokenizer = IncrementalDetokenizer(tok, prompt, False, detokenizer.dropped_ids)
    assert "".join(feed(detokenizer, ids)) == " so<|im_start|> ok"


@pytest.fixture(scope="module")
def wordpiece_tokenizer():
    """A WordPiece tokenizer (BERT's kind), whose decoder puts a space before every token, special ones included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]")


@pytest.mark.parametrize("python", [False, True], ids=["stream", "python"])
def test_spaces_between_special_tokens_false_joins_consecutive_added_tokens(wordpiece_tokenizer, python):
    """vLLM's option (before: ignored by the server, unknown to SamplingParams). Only between two added tokens, and
    only where they are not skipped; True (the default) is the tokenizer's own decoding."""
    tok = wordpiece_tokenizer
    prompt, ids = tok.encode("hello", add_special_tokens=False), tok.encode("[CLS] [SEP] [SEP] worlds")

    def text(skip: bool, spaces: bool) -> str:
        detokenizer = make_detokenizer(tok, prompt, skip, spaces_between_special_tokens=spaces)
        if python:
            detokenizer = IncrementalDetokenizer(tok, prompt, skip, joiner=detokenizer.joiner)
        return "".join(feed(detokenizer, ids))

    assert text(False, True) == tok.decode(prompt + ids)[len("hello"):] == " [CLS] [SEP] [SEP] worlds"
    assert text(False, False) == " [CLS][SEP][SEP] worlds"
    assert text(True, False) == text(True, True) == tok.decode(prompt + ids, skip_special_tokens=True)[len("hello"):]


def test_a_fast_tokenizer_gets_the_streaming_detokenizer(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert isinstance(make_detokenizer(tok, tok.encode("Hello there"), True), StreamDetokenizer)
    partial_byte = next(i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd")
    assert isinstance(make_detokenizer(tok, [*tok.encode("Hi"), partial_byte], True), IncrementalDetokenizer)


@settings(max_examples=200, deadline=None)
@given(prompt=st.lists(st.integers(0, 49151), max_size=8), output=st.lists(st.integers(0, 49151), max_size=24),
       chunk=st.integers(1, 4), skip=st.booleans())
def test_both_detokenizers_give_the_same_text_on_any_tokens(smollm2_tokenizer, prompt, output, chunk, skip):
    """Random tokens: partial characters anywhere, special tokens, prompts that end inside a character (for
    which make_detokenizer keeps the Python one)."""
    tok = smollm2_tokenizer
    expected = feed(IncrementalDetokenizer(tok, prompt, skip), output, chunk)
    assert feed(make_detokenizer(tok, prompt, skip), output, chunk) == expected

@pytest.mark.parametrize(
    "text, num_new, stops, expected",
    [
        ("abcSTOP", 4, ["STOP"], ("STOP", 3)),  # entirely in the new characters
        ("hello world", 2, ["world"], ("world", 6)),  # straddles old and new text
        ("STOP and more", 4, ["STOP"], None),  # only in old text: it was seen (and acted on) before
        ("STOP..STOP", 4, ["STOP"], ("STOP", 6)),  # the occurrence that ends in the new text
        ("xx ab cd", 5, ["cd", "ab"], ("ab", 3)),  # several: the earliest start wins, not list order
        ("STOP", 10, ["STOP"], ("STOP", 0)),  # num_new beyond the text's start
        ("ab", 2, ["abc"], None),  # longer than the text
        ("abSTOP", 0, ["STOP"], None),  # nothing new, nothing found
        ("aaab", 1, ["aab"], ("aab", 1)),  # self-overlapping prefix
        ("liftoff 🚀!", 2, ["🚀"], ("🚀", 8)),  # a multi-byte character as the stop string
    ],
)
def test_find_stop_string(text, num_new, stops, expected):
    assert find_stop_string(text, num_new, stops) == expected


def test_find_stop_string_on_streamed_text_matches_a_full_search():
    # Text arriving in random pieces: the first piece that completes a stop string must report the
    # earliest occurrence in the whole text, exactly as a search of the finished text would.
    rng = random.Random(0)
    stops = ["ab", "bba", "aaa", "abab"]
    for _ in range(500):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 30)))
        end, hit = 0, None
        while end < len(text) and hit is None:
            start, end = end, min(end + rng.randint(1, 5), len(text))
            hit = find_stop_string(text[:end], end - start, stops)
        starts = [text.find(s) for s in stops if s in text]
        assert (hit[1] if hit else None) == (min(starts) if starts else None), text
