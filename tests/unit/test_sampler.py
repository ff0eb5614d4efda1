"""The sampler's stages against transformers' logits processors, and its sampling distribution."""

import math

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tokenmill.sample.metadata import build_sampling_metadata
from tokenmill.sample.sampler import (
    Sampler,
    apply_min_p,
    apply_penalties,
    apply_penalties_to_seen,
    apply_top_k_top_p,
    gather_logprobs,
)
from tokenmill.sampling_params import FLOAT32_TINY, SamplingParams

VOCAB = 50
CPU = torch.device("cpu")


@pytest.fixture
def logits():
    return torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


def same_mask(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    finite = ~torch.isinf(ours)
    torch.testing.assert_close(ours[finite], theirs[finite])


@pytest.mark.parametrize("top_k", [1, 5, 49])
def test_top_k_matches_transformers(logits, top_k):
    ours = apply_top_k_top_p(logits, torch.full((4,), top_k), None)
    same_mask(ours, TopKLogitsWarper(top_k)(None, logits.clone()))


def test_top_k_beside_rows_without_it_matches_transformers(logits):
    """Rows without top_k (theirs is the vocabulary) stay whole and are not sorted; the others as transformers."""
    ours = apply_top_k_top_p(logits, torch.tensor([VOCAB, 3, VOCAB, 7]), None)
    assert torch.equal(ours[[0, 2]], logits[[0, 2]])
    for row, top_k in ((1, 3), (3, 7)):
        same_mask(ours[row : row + 1], TopKLogitsWarper(top_k)(None, logits[row : row + 1].clone()))


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9])
def test_top_p_matches_transformers(logits, top_p):
    ours = apply_top_k_top_p(logits, None, torch.full((4,), top_p))
    same_mask(ours, TopPLogitsWarper(top_p)(None, logits.clone()))


def test_top_k_then_top_p_per_row_parameters(logits):
    top_k, top_p = torch.tensor([3, 10, 50, 1]), torch.tensor([0.5, 0.9, 0.3, 1.0])
    ours = apply_top_k_top_p(logits, top_k, top_p)
    for row in range(4):
        theirs = TopKLogitsWarper(int(top_k[row]))(None, logits[row : row + 1].clone())
        if top_p[row] < 1:
            theirs = TopPLogitsWarper(float(top_p[row]))(None, theirs)
        same_mask(ours[row : row + 1], theirs)


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_matches_transformers(logits, min_p):
    same_mask(apply_min_p(logits, torch.full((4,), min_p)), MinPLogitsWarper(min_p)(None, logits.clone()))


def test_temperature_matches_transformers(logits):
    meta = build_sampling_metadata([SamplingParams(temperature=0.7)] * 4, {}, VOCAB, CPU)
    torch.testing.assert_close(logits / meta.temperature.unsqueeze(1), TemperatureLogitsWarper(0.7)(None, logits))


def test_repetition_penalty_matches_transformers(logits):
    history = torch.tensor([[1, 2, 3, 3], [4, 4, 4, 4], [0, 10, 20, 30], [49, 48, 1, 2]])
    counts = torch.zeros(4, VOCAB, dtype=torch.int32)
    counts.scatter_add_(1, history[:, 2:], torch.ones(4, 2, dtype=torch.int32))
    seen_mask = torch.zeros(4, VOCAB, dtype=torch.bool).scatter_(1, history, True)  # prompt and output
    zeros = torch.zeros(4)
    ours = apply_penalties(logits, counts, seen_mask, torch.full((4,), 1.3), zeros, zeros)
    torch.testing.assert_close(ours, RepetitionPenaltyLogitsProcessor(1.3)(history, logits.clone()))


def test_penalties_on_the_seen_tokens_equal_the_dense_penalties():
    """The CPU's sparse penalties give apply_penalties' values exactly; state rows picked out of a larger pool and
    out of order, seen tokens without output counts (the prompt's), input logits untouched."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 300, generator=generator) * 4
    seen_mask = torch.rand(9, 300, generator=generator) < 0.1
    output_counts = torch.randint(0, 4, (9, 300), generator=generator, dtype=torch.int32) * (
        torch.rand(9, 300, generator=generator) < 0.5) * seen_mask
    rows = torch.tensor([7, 0, 3, 3, 8])
    repetition, frequency, presence = (torch.tensor(v) for v in ([1.3, 1.0, 0.8, 1.1, 2.0], [0.5, -0.3, 0, 0.2, 1.0],
                                                                  [0.25, 0, 0.1, -0.5, 0.3]))
    before = logits.clone()
    ours = apply_penalties_to_seen(logits, output_counts, seen_mask, rows, repetition, frequency, presence)
    assert torch.equal(logits, before)
    assert torch.equal(ours, apply_penalties(logits, output_counts[rows], seen_mask[rows], repetition, frequency,
                                             presence))
    assert not torch.equal(ours, logits)


def test_frequency_and_presence_follow_the_openai_formula(logits):
    counts = torch.zeros(4, VOCAB, dtype=torch.int32)
    counts[0, 7] = 3
    counts[1, 8] = 1
    ours = apply_penalties(logits, counts, counts > 0, torch.ones(4),
                           torch.full((4,), 0.5), torch.full((4,), 0.25))
    expected = logits - 0.5 * counts - 0.25 * (counts > 0)
    torch.testing.assert_close(ours, expected)
    assert ours[0, 7] == pytest.approx(float(logits[0, 7]) - 1.5 - 0.25)


def test_logprobs_are_the_raw_log_softmax_with_ranks(logits):
    logprobs = logits.log_softmax(-1)
    chosen = torch.tensor([0, 1, 2, 3])
    out = gather_logprobs(logprobs, chosen, 3)
    torch.testing.assert_close(out.logprobs[:, 0], logprobs[torch.arange(4), chosen])
    torch.testing.assert_close(out.logprobs[:, 1:], logprobs.topk(3).values)
    expected_ranks = [int((logprobs[r] > logprobs[r, chosen[r]]).sum()) + 1 for r in range(4)]
    assert out.sampled_ranks.tolist() == expected_ranks


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
def test_logprobs_mode_picks_what_is_returned_and_not_what_is_drawn(logits, mode):
    """vLLM's logprobs_mode: the raw log_softmax or the raw logits, both before the temperature and top-k that
    the draw applies."""
    params = [SamplingParams(temperature=0.5, top_k=3, logprobs=2, seed=1)] * 2
    out = Sampler(mode)(logits[:2], build_sampling_metadata(params, {}, VOCAB, CPU))
    expected = logits[:2] if mode == "raw_logits" else logits[:2].log_softmax(-1)
    chosen = out.token_ids
    torch.testing.assert_close(out.logprobs.logprobs[:, 0], expected[torch.arange(2), chosen])
    torch.testing.assert_close(out.logprobs.logprobs[:, 1:], expected.topk(2).values)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token with zero probability"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=0.9, top_k=6, top_p=0.85, min_p=0.05),
    ],
    ids=["plain", "top_k", "top_p", "min_p", "top_k-candidates-with-top_p-min_p"],
)
def test_sampled_frequencies_match_the_processed_distribution(params):
    vocab, num_samples = 8, 20000
    torch.manual_seed(1234)  # unseeded rows draw from the global generator: fixed for determinism
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    logits = row.expand(num_samples, vocab).clone()
    meta = build_sampling_metadata([params] * num_samples, {}, vocab, CPU)
    tokens = Sampler()(logits, meta).token_ids
    counts = torch.bincount(tokens, minlength=vocab).float()
    processed = row.unsqueeze(0) / params.temperature
    if params.min_p:
        processed = apply_min_p(processed, torch.tensor([params.min_p]))
    if params.top_k or params.top_p < 1:
        processed = apply_top_k_top_p(processed, torch.tensor([params.top_k or vocab]), torch.tensor([params.top_p]))
    probs = processed.softmax(-1)[0]
    support = int((probs > 0).sum())
    # 99.9th percentile of chi-square with support-1 degrees of freedom (Wilson-Hilferty approximation).
    df = support - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3 if df > 0 else 0.0
    assert chi_square(counts, probs) < critical + 1e-6


def test_greedy_rows_ignore_noise_and_seeded_rows_use_their_generator(logits):
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)]
    gens = {1: torch.Generator().manual_seed(99)}
    first = Sampler()(logits[:2], build_sampling_metadata(params, gens, VOCAB, CPU)).token_ids
    gens = {1: torch.Generator().manual_seed(99)}
    second = Sampler()(logits[:2], build_sampling_metadata(params, gens, VOCAB, CPU)).token_ids
    assert first[0] == logits[0].argmax() and torch.equal(first, second)


@pytest.mark.parametrize("filters", [{}, {"top_p": 0.9, "min_p": 0.02}], ids=["top_k", "top_k-top_p-min_p"])
@pytest.mark.parametrize("draw_path", ["C kernel", "torch"])
def test_seeded_top_k_draw_does_not_depend_on_the_batch(logits, draw_path, filters, monkeypatch):
    """Alone, a seeded top-k row takes the candidate path; beside a row with a larger top_k too; beside a row
    without top_k the whole vocabulary's path: the same tokens (the CPU's C draw, and torch's noise without it)."""
    if draw_path == "torch":
        monkeypatch.setattr("tokenmill.sample.sampler.draw_applies", lambda logits: False)
        if filters:
            pytest.skip("torch's paths apply top_p differently (a cumsum over the candidates, a sort of the row)")
    seeded = SamplingParams(temperature=1.0, top_k=5, seed=11, **filters)
    wide = SamplingParams(temperature=1.0, top_k=40)
    whole = SamplingParams(temperature=0.8)

    def draws(params):
        meta = build_sampling_metadata(params, {}, VOCAB, CPU)
        assert meta.top_k_candidates == (0 if whole in params else max(p.top_k for p in params))
        tokens = []
        for seed in range(40):
            meta.generators = {0: torch.Generator().manual_seed(seed)}
            tokens.append(int(Sampler()(logits[: len(params)], meta).token_ids[0]))
        return tokens

    alone = draws([seeded])
    assert len(set(alone)) > 1  # the draws differ: the seed decides
    assert alone == draws([seeded, wide, wide]) == draws([seeded, whole, wide])


@pytest.mark.parametrize("draw", ["C", "torch"])
@pytest.mark.parametrize("filters", [{}, {"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}],
                         ids=["plain", "top_k", "top_p", "min_p"])
def test_a_repetition_penalty_that_overflows_the_seen_logits_draws_them_as_greedy_does(filters, draw, monkeypatch):
    """repetition_penalty at its smallest (float32's smallest normal number) divides the seen positive logits to
    +inf: those are then certain, and a sampled row draws among them, as the greedy row takes the first. The C draw
    answered token 0 (a token never seen) for every sampled row, and so did torch's (no C compiler, or CUDA without
    Triton): its softmax of inf - inf is NaN."""
    if draw == "torch":
        monkeypatch.setattr("tokenmill.sample.sampler.draw_applies", lambda logits: False)
    logits = torch.full((2, VOCAB), -2.0)
    logits[:, [3, 9, 17]] = torch.tensor([5.0, 6.0, 8.0])  # seen: 5 / FLOAT32_TINY is past float32's largest
    seen = torch.zeros(2, VOCAB, dtype=torch.bool)
    seen[:, [3, 9]] = True  # 17 is more likely, but not seen
    params = [SamplingParams(temperature=0.0, repetition_penalty=FLOAT32_TINY),
              SamplingParams(temperature=0.7, repetition_penalty=FLOAT32_TINY, **filters)]
    drawn = set()
    for seed in range(20):
        meta = build_sampling_metadata(params, {1: torch.Generator().manual_seed(seed)}, VOCAB, CPU,
                                       penalty_tensors=(torch.zeros(2, VOCAB), seen, np.array([0, 1])))
        greedy, sampled = Sampler()(logits, meta).token_ids.tolist()
        assert greedy == 3
        drawn.add(sampled)
    assert drawn == {3, 9}


def test_metadata_routes_rows_to_the_fused_draw_only_when_asked():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3),
              SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_k=5, top_p=0.8)]
    torch_draw = build_sampling_metadata(params, {}, VOCAB, CPU)  # no CUDA: the torch draw serves every row
    assert torch_draw.seeds is None and not torch_draw.use_kernels and torch_draw.is_greedy is not None
    assert torch_draw.top_k_candidates == 0  # a sampled row without top_k needs the whole vocabulary
    fused = build_sampling_metadata(params, {}, VOCAB, CPU, row_seeds={1: 2**62 + 7}, use_kernel=True)
    assert fused.use_kernels and fused.seeds.dtype == torch.int64 and int(fused.seeds[1]) == 2**62 + 7
    assert fused.draw_temperature.tolist() == pytest.approx([0.0, 0.7, 1.0, 1.0])
    assert fused.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9, 0.8])
    assert fused.top_k.tolist() == [VOCAB, VOCAB, VOCAB, 5] and fused.min_p is None
    assert fused.top_k_candidates == 0 and fused.is_greedy is None  # the kernels serve every row
    assert build_sampling_metadata(params[3:], {}, VOCAB, CPU).top_k_candidates == 5
    all_greedy = build_sampling_metadata(params[:1], {}, VOCAB, CPU, use_kernel=True)
    assert all_greedy.all_greedy and all_greedy.seeds is None  # torch's argmax


@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 6, 7, 8])
def test_metadata_columns_are_16_byte_aligned_for_every_batch_size(num_rows):
    """Triton specialises kernels on 16-byte pointer alignment: a column whose alignment changed with the
    batch size would compile new kernel variants mid-run. Every column starts on a 16-byte boundary of the
    one packed buffer they share."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=7, min_p=0.1, presence_penalty=0.5)] * num_rows
    counts = torch.zeros(num_rows, VOCAB, dtype=torch.int32)
    meta = build_sampling_metadata(params, {}, VOCAB, CPU, row_seeds={0: 1}, use_kernel=True,
                                   penalty_tensors=(counts, counts.bool(), np.arange(num_rows)))
    columns = [meta.top_k, meta.top_p, meta.min_p, meta.seeds, meta.draw_temperature, meta.presence_penalty,
               meta.frequency_penalty, meta.repetition_penalty, meta.penalty_rows]
    base = min(c.data_ptr() for c in columns)
    assert all((c.data_ptr() - base) % 16 == 0 for c in columns)
    assert meta.top_p.tolist() == pytest.approx([0.9] * num_rows)  # the padding is not part of the columns


def test_a_repeated_batch_reuses_its_metadata_until_a_row_changes():
    """Steady decoding samples the same rows step after step: their columns are copied to the device once.
    A row given to a new request, or a seeded row (its key follows its position), builds afresh."""
    from tokenmill.sample.state import SamplingState
    from tokenmill.worker.request_state import RequestStates

    state, states = SamplingState(4, VOCAB, CPU), RequestStates(4, 16, 4)

    def add(row, params):
        states.sampling_params[row] = params
        state.add_request(row, params, frozenset(), [1, 2], 2)

    for row, top_p in enumerate([0.5, 0.9, 1.0]):
        add(row, SamplingParams(temperature=1.0, top_p=top_p))
    rows = np.array([0, 1, 2])
    first = state.build_metadata(rows, states)
    assert state.build_metadata(rows.copy(), states).top_p is first.top_p  # the same device column
    assert state.build_metadata(rows[:2], states).top_p is not first.top_p  # another batch
    state.build_metadata(rows, states)  # the batch of `rows` is the last one again
    add(1, SamplingParams(temperature=1.0, top_p=0.3))
    assert state.build_metadata(rows, states).top_p.tolist() == pytest.approx([0.5, 0.3, 1.0])
    add(2, SamplingParams(temperature=1.0, seed=7))
    seeded = state.build_metadata(rows, states)
    assert state.build_metadata(rows, states).top_p is not seeded.top_p


def test_a_rows_fixed_mask_is_built_once_and_replaced_with_its_row():
    """allowed_token_ids and logit_bias give the same mask every step: built when the request arrives (ids given
    twice count once), copied each step beside the step's bans (min_tokens: the stop ids); a plain request taking
    the row has none."""
    from tokenmill.sample.state import SamplingState
    from tokenmill.worker.request_state import RequestStates

    state, states = SamplingState(2, VOCAB, CPU), RequestStates(2, 16, 4)

    def add(row, params):
        states.sampling_params[row] = params
        state.add_request(row, params, frozenset(), [1, 2], 2)

    params = SamplingParams(allowed_token_ids=[3, 5, 3, 7], logit_bias={5: 1.5, 9: -2.0}, stop_token_ids=[7, 7],
                            min_tokens=1)
    assert params.allowed_token_ids == [3, 5, 7] and params.stop_token_ids == [7] and 7 in params.stop_token_id_set
    add(0, params)
    add(1, SamplingParams())
    expected = torch.full((VOCAB,), float("-inf"))
    expected[[3, 5, 7]] = 0.0
    expected[5], expected[9] = 1.5, float("-inf")  # (-inf + -2: still banned)
    rows = np.array([0, 1])
    for _ in range(2):
        mask = state.build_metadata(rows, states).logit_mask
        banned = expected.clone()
        banned[7] = float("-inf")  # the stop id, before min_tokens
        assert torch.equal(mask[0], banned) and not mask[1].any()
    add(0, SamplingParams())
    assert state.build_metadata(rows, states).logit_mask is None


def test_reused_metadata_draws_fresh_keys_as_a_fresh_build_would():
    from tokenmill.sample.metadata import with_fresh_seeds

    params = [SamplingParams(temperature=0.8, top_p=0.9)] * 3
    built = build_sampling_metadata(params, {}, VOCAB, CPU, use_kernel=True)
    torch.manual_seed(5)
    reused = with_fresh_seeds(built)
    torch.manual_seed(5)
    fresh = build_sampling_metadata(params, {}, VOCAB, CPU, use_kernel=True)
    assert torch.equal(reused.seeds, fresh.seeds) and not torch.equal(reused.seeds, built.seeds)
    assert reused.top_p is built.top_p and reused.draw_temperature is built.draw_temperature


def test_greedy_ids_on_the_cpu_equal_torch_argmax_with_ties_and_nan():
    from tokenmill.sample.sampler import greedy_ids

    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (16, 1000), generator=generator).float()  # many ties per row
    logits[3, 17] = logits[3, 9] = float("nan")
    logits[5] = float("-inf")
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(greedy_ids(logits.to(dtype)), logits.to(dtype).argmax(dim=-1))
