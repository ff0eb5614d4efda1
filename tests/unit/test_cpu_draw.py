"""sample/cpu_draw.py: the CPU's inverse-CDF draw against float64 references."""

import math

import pytest
import torch

from tokenmill.sample.cpu_draw import MAX_DRAWS, draw_applies, draw_rows, load_kernel, row_uniforms

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no C compiler: the CPU draws with torch")

JUST_BELOW_ONE = 1.0 - 2.0**-53


def draw(rows: list[list[float]] | torch.Tensor, uniforms: list[float]) -> list[int]:
    logits = torch.as_tensor(rows, dtype=torch.float32)
    assert draw_applies(logits)
    return draw_rows(logits, torch.tensor(uniforms, dtype=torch.float64)).tolist()


@pytest.mark.parametrize("z", [0.0, -0.3, -1.0, -5.5, -17.0, -40.25, -63.0, -80.0, -85.9])
def test_each_weight_is_exp_of_its_logit_within_1e_5(z):
    """Row [z, 0]: token 0's share of the sum is e^z / (1 + e^z); uniforms 1e-5 (relative) either side of it
    fall on either token, so the kernel's exp is right to 1e-5 over the whole range it keeps."""
    boundary = math.exp(z) / (1 + math.exp(z))
    assert draw([[z, 0.0]] * 2, [boundary * (1 - 1e-5), boundary * (1 + 1e-5)]) == [0, 1]


def test_tokens_out_and_tokens_below_exp_minus_86_are_never_drawn():
    inf = float("inf")
    row = [-inf, 3.0, -inf, -90.0 + 3.0, 1.0, -inf]
    assert draw([row] * 3, [0.0, 0.5, JUST_BELOW_ONE]) == [1, 1, 4]
    assert draw([[-inf] * 3, [float("nan"), 0.0, 1.0]], [0.3, 0.3]) == [0, 0]  # nothing finite; a NaN row


def test_a_row_with_inf_logits_draws_among_them_as_the_argmax_would():
    """A logit that overflowed to +inf (a repetition penalty near float32's smallest normal number divides a seen
    logit, then the temperature) is certain: the draw keeps the +inf tokens alone, ties equally likely, under min_p
    and top_p too, where it answered token 0 (inf - inf is NaN: every weight 0)."""
    inf = float("inf")
    row = torch.tensor([-1.0, 2.0, inf, 3.0, -inf, inf, 0.5])
    uniforms = (torch.arange(64, dtype=torch.float64) + 0.5) / 64
    for filters in ({}, {"min_p": torch.full((64,), 0.5)}, {"top_p": torch.full((64,), 0.9)}):
        spread = uniforms.unsqueeze(1).expand(64, 1 + MAX_DRAWS) if "top_p" in filters else uniforms
        tokens = draw_rows(row.expand(64, -1).contiguous(), spread, **filters)
        assert torch.bincount(tokens, minlength=7).tolist() == [0, 0, 32, 0, 0, 32, 0], filters


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_most_likely():
    row = torch.tensor([math.log(p) for p in (0.02, 0.5, 0.049, 0.25, 0.051, 0.13)])
    uniforms = torch.arange(400, dtype=torch.float64) / 400
    tokens = draw_rows(row.expand(400, -1).contiguous(), uniforms, min_p=torch.full((400,), 0.1))
    assert set(tokens.tolist()) == {1, 3, 4, 5}  # 0.051 / 0.5 >= 0.1 > 0.049 / 0.5


def test_draws_are_the_float64_inverse_cdf_of_a_vocabulary_row_up_to_rounding():
    generator = torch.Generator().manual_seed(0)
    row = torch.randn(49152, generator=generator) * 4
    row[torch.randperm(49152, generator=generator)[:20000]] = float("-inf")
    uniforms = torch.rand(3000, dtype=torch.float64, generator=generator)
    tokens = torch.tensor(draw(row.expand(3000, -1), uniforms.tolist()))
    weights = torch.exp(row.double() - row.max())
    cdf = weights.cumsum(0) / weights.sum()
    expected = torch.searchsorted(cdf, uniforms, right=True)
    assert torch.isfinite(row[tokens]).all()
    differ = tokens != expected
    assert differ.sum() <= 3
    # Where they differ the uniform sits on a boundary of the reference's CDF (float32 weights: ~1e-7 of each).
    assert ((cdf[torch.minimum(tokens, expected)[differ]] - uniforms[differ]).abs() < 1e-6).all()


def test_frequencies_follow_the_softmax():
    torch.manual_seed(7)
    row = torch.tensor([2.0, 1.5, -1.0, float("-inf"), 0.0, 3.0, -6.0, 2.9])
    num = 60000
    tokens = torch.tensor(draw(row.expand(num, -1), torch.rand(num, dtype=torch.float64).tolist()))
    counts = torch.bincount(tokens, minlength=len(row)).double()
    probs = row.double().softmax(0)
    assert counts[3] == 0
    keep = probs > 0
    chi_square = float(((counts[keep] - num * probs[keep]) ** 2 / (num * probs[keep])).sum())
    assert chi_square < 24.3  # 99.95th percentile of chi-square with 6 degrees of freedom


def test_rows_over_threads_draw_as_rows_on_one_thread():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(37, 3000, generator=generator)[:, :2500]  # rows `stride` apart, not contiguous
    uniforms = torch.rand(37, dtype=torch.float64, generator=generator)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = draw_rows(logits, uniforms)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(draw_rows(logits, uniforms), one)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, torch.stack([draw_rows(logits[i : i + 1], uniforms[i : i + 1])[0] for i in range(37)]))


def top_p_reference(row: torch.Tensor, uniforms: torch.Tensor, top_p: float) -> int:
    """The Triton kernels' top-p rule in float64: a draw whose strictly more likely tokens hold top_p of the mass or
    more is redrawn among them with the next uniform."""
    weights = torch.exp(row.double() - row.max())
    total = weights.sum()

    def inverse_cdf(w, u):
        return int(torch.searchsorted(w.cumsum(0), u * w.sum(), right=True))

    token = inverse_cdf(weights, uniforms[0])
    for k in range(1, MAX_DRAWS + 1):
        above = weights * (weights > weights[token])
        if above.sum() < top_p * total:
            return token
        token = inverse_cdf(above, uniforms[k])
    return int(weights.argmax())


@pytest.mark.parametrize("top_p", [0.9, 0.5, 0.05])
def test_top_p_draws_are_the_rejection_rule_of_the_gpu_kernels(top_p):
    generator = torch.Generator().manual_seed(2)
    row = torch.randn(5000, generator=generator) * 2
    row[:1000] = float("-inf")
    num = 1500
    uniforms = torch.rand(num, 1 + MAX_DRAWS, dtype=torch.float64, generator=generator)
    tokens = draw_rows(row.expand(num, -1).contiguous(), uniforms, torch.full((num,), top_p))
    expected = torch.tensor([top_p_reference(row, uniforms[i], top_p) for i in range(num)])
    assert (tokens != expected).sum() <= 3
    # Every token drawn is in the nucleus: the tokens more likely than it hold less than top_p.
    probs = row.double().softmax(0)
    assert all(float(probs[probs > probs[t]].sum()) < top_p for t in tokens.tolist())


def test_a_seeded_rows_uniforms_are_its_own_generators_as_many_as_its_draw_reads():
    top_p = torch.tensor([1.0, 0.9, 1.0])
    uniforms = row_uniforms(3, {0: torch.Generator().manual_seed(4), 1: torch.Generator().manual_seed(4)}, top_p)
    assert uniforms.shape == (3, 1 + MAX_DRAWS)
    assert uniforms[0, 0] == torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(4))[0]
    assert torch.equal(uniforms[1], torch.rand(1 + MAX_DRAWS, dtype=torch.float64,
                                               generator=torch.Generator().manual_seed(4)))
    # Alone (no top_p in the batch) the first row reads the same one uniform.
    assert row_uniforms(1, {0: torch.Generator().manual_seed(4)}, None)[0, 0] == uniforms[0, 0]
