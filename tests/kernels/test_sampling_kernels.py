"""The fused temperature + inverse-CDF draw (kernels/sampling.py): torch.argmax for greedy rows, its float64
reference for sampled rows, softmax(logits / T) for the draws, and the sampler's use of it.

Small tiles (16 tokens) split a small vocabulary into several tiles and programs. Under TRITON_INTERPRET=1
a program costs tens of milliseconds, so the cases stay small there. The kernels sum in float32 and the
references in float64: a token differs only where a uniform falls within rounding of a boundary between
two tokens, which these fixed seeds never hit. The tests marked `interpret` are those CI runs so.
"""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.sample.metadata import build_sampling_metadata
from tokenmill.sample.sampler import Sampler
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu
interpret = pytest.mark.interpret

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_seeds(num_rows: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2**63 - 1, (num_rows,), generator=torch.Generator().manual_seed(seed))


@interpret
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_greedy_rows_are_torch_argmax(device, dtype):
    from tokenmill.kernels.sampling import categorical_draw, greedy_argmax

    # Integer logits tie often, within a tile and across splits; the view's rows are 130 apart.
    wide = torch.randint(-4, 5, (6, 130), generator=torch.Generator().manual_seed(0)).to(dtype)
    wide[2] = float("-inf")
    wide[3, 101] = 9.0  # the only maximum, in the last tile
    logits = wide.to(device)[:, :120]
    zeros = torch.zeros(6, device=device)
    expected = logits.float().cpu().argmax(dim=-1)  # the first maximum
    for tiles_per_split in (1, 3, None):
        out = categorical_draw(logits, zeros, make_seeds(6, 1).to(device), tile=16, tiles_per_split=tiles_per_split)
        assert out.dtype == torch.int64 and torch.equal(out.cpu(), expected)
    assert torch.equal(greedy_argmax(logits).cpu(), expected)


@interpret
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_draw_matches_reference_for_any_split(device, dtype):
    from tokenmill.kernels.sampling import categorical_draw, categorical_draw_ref

    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(6, 64, generator=gen) * 2).to(dtype).to(device)[:, :50]
    temperature = torch.tensor([0.0, 0.3, 1.0, 2.5, 1.0, 0.7], device=device)
    seeds = make_seeds(6, 3).to(device)
    expected = categorical_draw_ref(logits, temperature, seeds).cpu()
    for tiles_per_split in (1, 2, None):
        out = categorical_draw(logits, temperature, seeds, tile=16, tiles_per_split=tiles_per_split)
        assert torch.equal(out.cpu(), expected)
    assert expected[0] == logits[0].float().argmax().cpu()


@interpret
def test_draw_matches_reference_with_production_tiles(device):
    from tokenmill.kernels.sampling import TILE, categorical_draw, categorical_draw_ref

    vocab = TILE + 300  # two tiles: the second one partly masked
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(4)).to(device)
    temperature = torch.tensor([1.0, 0.5, 0.0, 3.0], device=device)
    seeds = make_seeds(4, 5).to(device)
    expected = categorical_draw_ref(logits, temperature, seeds).cpu()
    assert torch.equal(categorical_draw(logits, temperature, seeds).cpu(), expected)
    assert torch.equal(categorical_draw(logits, temperature, seeds, tiles_per_split=1).cpu(), expected)


def test_same_seed_repeats_and_each_seed_changes_the_draw(device):
    from tokenmill.kernels.sampling import categorical_draw

    num_rows, vocab = 32, 64
    logits = torch.zeros(num_rows, vocab, device=device)  # uniform: every draw is pure chance
    temperature = torch.ones(num_rows, device=device)

    def draw(seeds):
        return categorical_draw(logits, temperature, seeds, tile=16).cpu()

    seeds = make_seeds(num_rows, 6).to(device)
    by_seed = draw(seeds)
    assert len(set(by_seed.tolist())) >= 16  # 32 uniform draws over 64 tokens: ~25 distinct
    # The same seed gives the same token in any row of any batch.
    assert torch.equal(draw(seeds.flip(0)), by_seed.flip(0))
    assert len(set(draw(torch.full_like(seeds, 12345)).tolist())) == 1


def chi_square_critical(df: int) -> float:
    """99.9th percentile of chi-square with df degrees of freedom (Wilson-Hilferty approximation)."""
    return df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3


def test_draws_follow_softmax_of_logits_over_temperature(device):
    from tokenmill.kernels.sampling import categorical_draw, categorical_draw_ref

    num_draws, temperature = 20000, 0.7
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 0.2, 1.2, -2.0, 0.8] * 2)
    logits = row.expand(num_draws, len(row)).to(device)  # 24 tokens: two tiles, two programs per row
    temperatures = torch.full((num_draws,), temperature, device=device)
    seeds = make_seeds(num_draws, 7).to(device)
    if device == "cuda":
        tokens = categorical_draw(logits, temperatures, seeds, tile=16, tiles_per_split=1)
    else:
        # 40k interpreted programs take too long: the reference draws instead; the tests above
        # check that it returns exactly the kernel's tokens.
        tokens = categorical_draw_ref(logits, temperatures, seeds)
    counts = torch.bincount(tokens.cpu(), minlength=len(row)).double()
    expected = (row.double() / temperature).softmax(-1) * num_draws
    assert float(((counts - expected) ** 2 / expected).sum()) < chi_square_critical(len(row) - 1)


def nucleus_probs(row: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """softmax(row / T) renormalised over the tokens whose strictly more likely tokens hold < top_p."""
    probs = (row.double() / temperature).softmax(-1)
    above = torch.stack([probs[row > value].sum() for value in row])
    kept = probs * (above < top_p)
    return kept / kept.sum()


@interpret
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_top_p_draw_matches_reference(device, dtype):
    from tokenmill.kernels.sampling import categorical_draw, top_p_draw, top_p_draw_ref

    gen = torch.Generator().manual_seed(9)
    logits = (torch.randn(8, 64, generator=gen) * 2).to(dtype)
    logits[7, :5] = torch.tensor([2.0, 1.0, 1.0, 1.0, 1.0])  # the nucleus boundary falls inside a tie
    logits[7, 5:] = -8.0
    logits = logits.to(device)[:, :50]
    temperature = torch.tensor([0.0, 1.0, 0.5, 2.0, 1.0, 1.0, 0.7, 1.0], device=device)
    top_p = torch.tensor([0.5, 1.0, 0.3, 0.9, 0.05, 0.5, 0.95, 0.4], device=device)
    seeds = make_seeds(8, 10).to(device)
    out = top_p_draw_ref(logits, temperature, top_p, seeds).cpu()
    for tiles_per_split in (1, 3, None):  # the softmax mass in 4, 2 and 1 parts
        drawn = top_p_draw(logits, temperature, top_p, seeds, tile=16, tiles_per_split=tiles_per_split)
        assert torch.equal(drawn.cpu(), out)
    plain = categorical_draw(logits, temperature, seeds, tile=16).cpu()
    assert out[0] == plain[0] == logits[0].float().argmax().cpu() and out[1] == plain[1]
    for row in range(1, 8):
        assert nucleus_probs(logits[row].float().cpu(), float(temperature[row]), float(top_p[row]))[out[row]] > 0


# (logits, temperature, top_p): a smooth row, and one whose boundary cuts a tie (all four 1.0s are kept).
NUCLEUS_CASES = {
    "smooth": ([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 0.2, 1.2, -2.0, 0.8] * 2, 0.9, 0.8),
    "tie": ([2.0, 1.0, 1.0, 1.0, 1.0] + [-1.0] * 19, 1.0, 0.4),
}


@pytest.mark.parametrize("case", list(NUCLEUS_CASES))
def test_top_p_draws_follow_the_renormalised_nucleus(device, case):
    from tokenmill.kernels.sampling import top_p_draw, top_p_draw_ref

    values, temperature, top_p = NUCLEUS_CASES[case]
    num_draws, row = 20000, torch.tensor(values)
    logits = row.expand(num_draws, len(row)).to(device)
    temperatures = torch.full((num_draws,), temperature, device=device)
    top_ps = torch.full((num_draws,), top_p, device=device)
    seeds = make_seeds(num_draws, 11).to(device)
    draw = top_p_draw if device == "cuda" else top_p_draw_ref  # the interpreter is too slow; see above
    tokens = draw(logits, temperatures, top_ps, seeds, **({"tile": 16} if device == "cuda" else {})).cpu()
    few = slice(0, 32)  # the kernel on a few rows here too: many first draws land on the boundary
    assert torch.equal(top_p_draw(logits[few], temperatures[few], top_ps[few], seeds[few], tile=16).cpu(), tokens[few])
    counts = torch.bincount(tokens, minlength=len(row)).double()
    probs = nucleus_probs(row, temperature, top_p)
    assert counts[probs == 0].sum() == 0
    expected = probs[probs > 0] * num_draws
    df = int((probs > 0).sum()) - 1
    assert float(((counts[probs > 0] - expected) ** 2 / expected).sum()) < chi_square_critical(df)


@interpret
def test_sampler_draws_each_row_by_its_own_parameters(device):
    """A seeded row draws the same token alone, beside other rows, and beside top-p, top-k and min_p rows:
    every row takes the fused draw, each by its own parameters."""
    from tokenmill.kernels.sampling import categorical_draw_ref

    vocab = 50
    logits = (torch.randn(6, vocab, generator=torch.Generator().manual_seed(8)) * 2).to(device)
    greedy, seeded = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1)
    nucleus, plain = SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.2)
    top_k, min_p = SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.0, min_p=0.3)
    step_seed = 987654321

    def run(params, seeded_row, rows):
        meta = build_sampling_metadata(params, {}, vocab, torch.device(device), row_seeds={seeded_row: step_seed},
                                       use_kernel=True)
        return meta, Sampler()(logits[rows], meta).token_ids.cpu()

    meta, alone = run([seeded], 0, [1])
    assert meta.seeds is not None and meta.top_p is None and meta.top_k is None and meta.min_p is None
    _, batched = run([greedy, seeded, plain], 1, [0, 1, 2])
    meta, mixed = run([top_k, seeded, greedy, nucleus, min_p], 1, [4, 1, 0, 3, 5])
    assert meta.top_k.tolist() == [3, vocab, vocab, vocab, vocab] and meta.top_k_candidates == 0
    expected = categorical_draw_ref(logits[1:2], torch.tensor([0.8]), torch.tensor([step_seed]))
    assert alone.tolist() == [int(expected)] and batched[1] == mixed[1] == expected
    assert batched[0] == mixed[2] == logits[0].argmax().cpu()
    assert nucleus_probs(logits[3].cpu(), 1.0, 0.5)[mixed[3]] > 0
    assert mixed[0] in logits[4].topk(3).indices.cpu()
    probs = logits[5].softmax(-1).cpu()
    assert probs[mixed[4]] >= 0.3 * probs.max()
