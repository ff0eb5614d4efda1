"""The candidate floor (kernels/sampling_floor.py: top_k by radix select, min_p), the draws among the
candidates, and the fused mask + penalty pass (kernels/penalties.py), against torch.

Under TRITON_INTERPRET=1 a program costs tens of milliseconds, so the cases stay small there; CI runs the ones
marked `interpret` so (a tl.sort of a 1024-token tile, in the three-pass top_k, takes about a second there).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernels.test_sampling_kernels import DTYPES, chi_square_critical, make_seeds, nucleus_probs
from tokenmill.sample.metadata import build_sampling_metadata
from tokenmill.sample.sampler import Sampler, apply_penalties
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu
interpret = pytest.mark.interpret


def kept(logits: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    return logits.float().cpu() >= floor.cpu()[:, None]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# Three splits per row, and one; the lane-maxima path for k <= 1024 (row 3's candidates overflow), or the radix
# select for every row (the interpreter's case: the lane maxima's sort of a 1024-token tile is slow there).
@pytest.mark.parametrize("layout", [(1, 8, True), (None, 4, True), pytest.param((1, 8, False), marks=interpret),
                                    (None, 4, False)], ids=["split_fast", "whole_fast", "split_radix", "whole_radix"])
def test_top_k_floor_keeps_the_k_largest_and_their_ties(device, dtype, layout):
    from tokenmill.kernels.sampling_floor import candidate_floor, candidate_floor_ref

    gen = torch.Generator().manual_seed(0)
    vocab = 2500  # three 1024-token tiles, the last one partly masked
    logits = torch.randn(8, vocab, generator=gen) * 3
    logits[1] = torch.randint(-3, 4, (vocab,), generator=gen).float()  # seven values, each tied ~350 times
    logits[2] = -logits[2].abs() - 1  # all negative: the floor sits below the k-th value
    logits[3, :100] = float("-inf")
    logits = logits.to(dtype)
    top_k = torch.tensor([1, 5, 50, 1000, vocab - 1, vocab, 7, 3])
    temperature = torch.tensor([1.0, 1.0, 0.7, 1.0, 2.0, 1.0, 0.0, 0.5])
    ref = candidate_floor_ref(logits, temperature, top_k, None)
    sampled = temperature > 0
    tiles_per_split, digit_bits, fast = layout
    floor = candidate_floor(logits.to(device), temperature.to(device), top_k.to(device), None,
                            tiles_per_split=tiles_per_split, digit_bits=digit_bits, fast_top_k=fast).cpu()
    assert torch.equal(kept(logits, floor)[sampled], kept(logits, ref)[sampled])
    assert floor[5] == float("-inf")  # top_k = vocab: no floor
    counts = kept(logits, floor).sum(-1)
    assert counts[1] > 5  # row 1 keeps its ties
    if dtype == torch.float32:  # no ties elsewhere (16-bit values may tie at the k-th)
        assert counts[[0, 2, 3, 4]].tolist() == [1, 50, 1000, vocab - 1]


# min_p alone under the interpreter: a top_k takes the three passes, whose sort of a 1024-token tile is slow there.
@pytest.mark.parametrize("with_top_k", [pytest.param(False, marks=interpret), True], ids=["min_p", "min_p+top_k"])
def test_min_p_floor_alone_and_with_top_k(device, with_top_k):
    from tokenmill.kernels.sampling_floor import candidate_floor, candidate_floor_ref

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1)) * 2
    temperature = torch.tensor([1.0, 0.5, 2.0, 1.0, 1.0, 0.0])
    min_p = torch.tensor([0.1, 0.05, 0.3, 0.0, 0.2, 0.5])
    top_k = torch.tensor([300, 300, 10, 5, 3, 300])
    args = [t.to(device) for t in (logits, temperature)]
    given = logits.amax(-1, keepdim=True).to(device)  # one split per row here
    for k, maxima in ((top_k, None), (top_k, given)) if with_top_k else ((None, None), (None, given)):
        floor = candidate_floor(*args, None if k is None else k.to(device), min_p.to(device), maxima=maxima).cpu()
        ref = candidate_floor_ref(logits, temperature, k, min_p)
        torch.testing.assert_close(floor[:5], ref[:5], rtol=1e-6, atol=1e-6)
        probs = (logits / temperature[:, None]).softmax(-1)
        survivors = kept(logits, floor)
        assert torch.equal(survivors[:3], (probs >= min_p[:, None] * probs.amax(-1, keepdim=True))[:3] & (
            True if k is None else kept(logits, ref)[:3]))


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.float16, marks=interpret), torch.bfloat16],
                         ids=str)
def test_draws_among_the_candidates_match_reference(device, dtype):
    from tokenmill.kernels.sampling import categorical_draw, categorical_draw_ref, top_p_draw, top_p_draw_ref
    from tokenmill.kernels.sampling_floor import candidate_floor_ref

    gen = torch.Generator().manual_seed(12)
    logits = (torch.randn(8, 64, generator=gen) * 2).to(dtype)[:, :50]
    temperature = torch.tensor([0.0, 1.0, 0.5, 2.0, 1.0, 1.0, 0.7, 1.0])
    top_p = torch.tensor([0.5, 1.0, 0.3, 0.9, 0.05, 0.5, 0.95, 0.8])
    top_k = torch.tensor([3, 5, 50, 10, 2, 50, 20, 1])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.2, 0.0, 0.0])
    floor = candidate_floor_ref(logits, temperature, top_k, min_p)
    seeds = make_seeds(8, 13)
    draw = categorical_draw_ref(logits, temperature, seeds, floor=floor)
    nucleus = top_p_draw_ref(logits, temperature, top_p, seeds, floor=floor)
    assert kept(logits, floor)[torch.arange(8)[1:], nucleus[1:]].all() and nucleus[7] == logits[7].float().argmax()
    on = [t.to(device) for t in (logits, temperature, top_p, seeds, floor)]
    for tiles_per_split in (1, 3, None):
        assert torch.equal(categorical_draw(on[0], on[1], on[3], floor=on[4], tile=16,
                                            tiles_per_split=tiles_per_split).cpu(), draw)
        for rounds in (0, 1, 2):  # redraws over splits, or in one program per row: the same draws
            assert torch.equal(top_p_draw(*on[:4], floor=on[4], tile=16, tiles_per_split=tiles_per_split,
                                          parallel_rounds=rounds).cpu(), nucleus)


def test_top_k_top_p_draws_follow_the_nucleus_of_the_top_k(device):
    from tokenmill.kernels.sampling import top_p_draw, top_p_draw_ref
    from tokenmill.kernels.sampling_floor import candidate_floor

    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 0.2, 1.2, -2.0, 0.8] * 2)
    num_draws, temperature, top_p, top_k = 20000, 0.9, 0.8, 9
    logits = row.expand(num_draws, len(row)).to(device)
    temperatures = torch.full((num_draws,), temperature, device=device)
    top_ps = torch.full((num_draws,), top_p, device=device)
    floor = candidate_floor(logits[:1], temperatures[:1], torch.tensor([top_k], device=device), None)
    floor = floor.expand(num_draws).contiguous()
    seeds = make_seeds(num_draws, 14).to(device)
    draw = top_p_draw if device == "cuda" else top_p_draw_ref  # the interpreter is too slow for 20k rows
    tokens = draw(logits, temperatures, top_ps, seeds, floor=floor, **({"tile": 16} if device == "cuda" else {})).cpu()
    top = row.masked_fill(row < row.topk(top_k).values[-1], float("-inf"))  # 9 largest: ties at 1.0 make 10
    probs = nucleus_probs(top, temperature, top_p)
    counts = torch.bincount(tokens, minlength=len(row)).double()
    assert counts[probs == 0].sum() == 0
    expected = probs[probs > 0] * num_draws
    df = int((probs > 0).sum()) - 1
    assert float(((counts[probs > 0] - expected) ** 2 / expected).sum()) < chi_square_critical(df)


@interpret
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_penalties_equal_the_torch_reference(device, dtype):
    from tokenmill.kernels.penalties import apply_penalties_fused

    gen = torch.Generator().manual_seed(15)
    max_reqs, vocab = 6, 1500  # two tiles
    counts = torch.randint(0, 4, (max_reqs, vocab), generator=gen, dtype=torch.int32)
    counts *= torch.rand(max_reqs, vocab, generator=gen) < 0.05
    seen_mask = (torch.rand(max_reqs, vocab, generator=gen) < 0.1) | (counts > 0)  # prompt or output
    state_rows = torch.tensor([4, 0, 2])
    wide = (torch.randn(3, vocab + 20, generator=gen) * 3).to(dtype)
    logits = wide[:, :vocab]  # a row stride wider than the vocabulary
    repetition, frequency, presence = torch.tensor([1.3, 1.0, 0.8]), torch.tensor([0.5, 0.0, -0.2]), torch.tensor(
        [0.1, 0.0, 0.3])  # row 1: no penalties, only the conversion (and mask)
    mask = torch.zeros(3, vocab)
    mask[0, :10] = float("-inf")
    mask[2, 5] = 2.5
    for logit_mask in (None, mask):
        ref_in = logits.float() + (0 if logit_mask is None else logit_mask)
        ref = apply_penalties(ref_in, counts[state_rows], seen_mask[state_rows], repetition, frequency, presence)
        out, maxima = apply_penalties_fused(
            *[t.to(device) if t is not None else None for t in (logits, logit_mask, state_rows, counts, seen_mask,
                                                               repetition, frequency, presence)])
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.cpu(), ref, rtol=2e-6, atol=0)
        # the maxima of candidate_floor's splits: one 1024-token tile each here
        expected = torch.stack([ref[:, :1024].amax(-1), ref[:, 1024:].amax(-1)], dim=1)
        torch.testing.assert_close(maxima.cpu(), expected, rtol=2e-6, atol=0)


@interpret
def test_sampler_penalties_and_filters_agree_with_the_torch_path(device):
    """Greedy rows after penalties and a mask: the kernels' tokens are torch's; sampled rows stay inside
    their top_k and min_p."""
    vocab, gen = 300, torch.Generator().manual_seed(16)
    logits = torch.randn(4, vocab, generator=gen) * 2
    counts = (torch.rand(4, vocab, generator=gen) < 0.3).to(torch.int32) * 2
    seen_mask = (torch.rand(4, vocab, generator=gen) < 0.3) | (counts > 0)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5), SamplingParams(temperature=0.0,
              frequency_penalty=1.0, presence_penalty=0.5), SamplingParams(temperature=0.0)]
    mask = torch.zeros(3, vocab)
    mask[2, logits[1].argmax()] = float("-inf")
    rows = np.array([3, 1, 0])
    tokens = {}
    for use_kernel in (False, True):
        on = device if use_kernel else "cpu"
        state = (counts.to(on), seen_mask.to(on), rows)
        meta = build_sampling_metadata(params, {}, vocab, torch.device(on), logit_mask=mask.to(on),
                                       penalty_tensors=state, use_kernel=use_kernel)
        tokens[use_kernel] = Sampler()(logits[:3].to(on), meta).token_ids.cpu()
    assert torch.equal(tokens[False], tokens[True])
    sampled = [SamplingParams(temperature=1.0, top_k=4, repetition_penalty=1.2), SamplingParams(temperature=1.0,
               min_p=0.5, frequency_penalty=0.3)]
    state = (counts.to(device), seen_mask.to(device), rows[:2])
    meta = build_sampling_metadata(sampled, {}, vocab, torch.device(device), penalty_tensors=state, use_kernel=True)
    out = Sampler()(logits[:2].to(device), meta).token_ids.cpu()
    penalised = apply_penalties(logits[:2], counts[rows[:2]], seen_mask[rows[:2]], torch.tensor([1.2, 1.0]),
                                torch.tensor([0.0, 0.3]), torch.zeros(2))
    assert out[0] in penalised[0].topk(4).indices
    probs = penalised[1].softmax(-1)
    assert probs[out[1]] >= 0.5 * probs.max()


def test_rows_drawn_among_their_candidates_get_the_full_vocabulary_draw(device):
    """candidate_floor's draw of the small-top_k rows equals top_p_draw over the whole row (same uniforms,
    same rejection rounds); the other rows are left to it, with their temperature unchanged."""
    from tokenmill.kernels.sampling import top_p_draw_ref
    from tokenmill.kernels.sampling_floor import CandidateDraw, candidate_floor, candidate_floor_ref

    vocab = 1500
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(17)) * 2
    logits[5, :40] = 4.0  # ties across the k-th value
    temperature = torch.tensor([1.0, 0.7, 1.3, 0.0, 1.0, 1.0, 0.9])
    top_k = torch.tensor([3, 10, 50, 5, 300, 20, 256])  # row 4: above MAX_FAST_K, the radix select's
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.5, 0.8, 0.3, 0.95])
    min_p = torch.tensor([0.0, 0.0, 0.2, 0.0, 0.0, 0.1, 0.0])
    seeds = make_seeds(7, 18)
    floor_ref = candidate_floor_ref(logits, temperature, top_k, min_p)
    expected = top_p_draw_ref(logits, temperature, top_p, seeds, floor=floor_ref)
    on = [t.to(device) for t in (logits, temperature, top_k, min_p, top_p, seeds)]
    tokens = torch.full((7,), -1, dtype=torch.int64, device=device)
    draw = CandidateDraw(on[4], on[5], tokens, on[1].clone())
    floor = candidate_floor(on[0], on[1], on[2], on[3], draw=draw).cpu()
    drawn = torch.tensor([True, True, True, False, False, True, True])
    assert torch.equal(draw.temperature.cpu() == -1, drawn)
    assert torch.equal(draw.temperature.cpu()[~drawn], temperature[~drawn])
    assert torch.equal(tokens.cpu()[drawn], expected[drawn])
    assert (tokens.cpu()[~drawn] == -1).all()
    sampled = temperature > 0
    assert torch.equal(kept(logits, floor)[sampled], kept(logits, floor_ref)[sampled])


@interpret
def test_rows_whose_candidates_overflow_take_one_program_each(device):
    """With every top_k small, rows whose candidates overflow the slots (ties) get their floor and token from
    the per-row program: the same as the reference, like the rows served by the three passes."""
    from tokenmill.kernels.sampling import top_p_draw_ref
    from tokenmill.kernels.sampling_floor import CANDIDATES, CandidateDraw, candidate_floor, candidate_floor_ref

    vocab = 2500
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(19)) * 2
    logits[0] = 1.5  # every logit tied: all are candidates
    logits[1, : CANDIDATES + 50] = 6.0  # more ties at the top than slots
    logits = logits.to(torch.bfloat16)
    temperature = torch.tensor([1.0, 0.8, 1.0, 0.7])
    top_k = torch.tensor([5, 10, 40, 3])
    top_p = torch.tensor([0.5, 0.9, 0.7, 1.0])
    min_p = torch.tensor([0.0, 0.1, 0.05, 0.0])
    seeds = make_seeds(4, 20)
    floor_ref = candidate_floor_ref(logits, temperature, top_k, min_p)
    expected = top_p_draw_ref(logits, temperature, top_p, seeds, floor=floor_ref)
    on = [t.to(device) for t in (logits, temperature, top_k, min_p, top_p, seeds)]
    draw = CandidateDraw(on[4], on[5], torch.full((4,), -1, dtype=torch.int64, device=device), on[1].clone())
    floor = candidate_floor(on[0], on[1], on[2], on[3], draw=draw, small_top_k=True).cpu()
    assert torch.equal(kept(logits, floor), kept(logits, floor_ref))
    assert (draw.temperature.cpu() == -1).all()
    assert torch.equal(draw.tokens.cpu(), expected)
    assert logits[1, expected[1]] == 6.0 and kept(logits, floor).sum(-1)[0] == vocab


def test_sampler_with_small_top_k_in_every_row_draws_each_row_by_itself(device):
    """Every row drawn among its candidates (no full-vocabulary pass): a seeded row's token is the reference's,
    alone and beside another row."""
    from tokenmill.kernels.sampling import top_p_draw_ref
    from tokenmill.kernels.sampling_floor import candidate_floor_ref

    vocab, step_seed = 300, 123456789
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(21)) * 2
    seeded = SamplingParams(temperature=0.9, top_k=20, top_p=0.8, seed=5)
    other = SamplingParams(temperature=1.0, top_k=7, min_p=0.1)

    def run(params, rows):
        meta = build_sampling_metadata(params, {}, vocab, torch.device(device), row_seeds={0: step_seed},
                                       use_kernel=True)
        assert meta.max_top_k == max(p.top_k for p in params) and not meta.has_greedy_rows
        return Sampler()(logits[rows].to(device), meta).token_ids.cpu()

    t, k, p = torch.tensor([0.9]), torch.tensor([20]), torch.tensor([0.8])
    expected = top_p_draw_ref(logits[:1], t, p, torch.tensor([step_seed]), floor=candidate_floor_ref(logits[:1], t, k,
                                                                                                      None))
    assert run([seeded], [0])[0] == expected[0] == run([seeded, other], [0, 1])[0]


@interpret
def test_penalties_applied_on_load_equal_the_penalty_pass(device):
    """Penalised rows without a top_k: the draw kernels penalise each logit as they load it. In every row a
    seen token leads an unseen one by 0.5, far above the rest: each penalised row's penalty puts the unseen
    one first (at T = 0.1 the draws are all but certain). The tokens are those of the same batch through
    the penalty pass (a zero logit mask sends it there: same seeds, same float32 values), and the draws' own
    references over torch's penalised logits."""
    import dataclasses

    from tokenmill.kernels.sampling import categorical_draw_ref, top_p_draw_ref
    from tokenmill.sample.sampler import penalties_on_load

    vocab, gen = 1500, torch.Generator().manual_seed(22)
    logits = torch.randn(5, vocab, generator=gen)
    seen, unseen = torch.tensor([7, 1100, 300, 1499, 42]), torch.tensor([8, 20, 1024, 0, 43])
    logits[torch.arange(5), seen], logits[torch.arange(5), unseen] = 10.0, 9.5
    logits = logits.to(torch.bfloat16)
    rows = np.array([4, 0, 2, 5, 1])
    counts = torch.zeros(6, vocab, dtype=torch.int32)
    counts[:, :200] = torch.randint(0, 3, (6, 200), generator=gen, dtype=torch.int32)
    counts[rows, seen] = 3
    seen_mask = (torch.rand(6, vocab, generator=gen) < 0.1) | (counts > 0)
    seen_mask[rows, unseen] = False
    counts[rows, unseen] = 0
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5),  # 10 / 1.5 < 9.5
              SamplingParams(temperature=0.1, frequency_penalty=0.5, presence_penalty=0.3),  # 10 - 1.5 - 0.3
              SamplingParams(temperature=0.1, top_p=0.6, repetition_penalty=1.2),  # 10 / 1.2
              SamplingParams(temperature=0.1, min_p=0.2, frequency_penalty=1.0),  # 10 - 3
              SamplingParams(temperature=0.1, top_p=0.9)]  # no penalties: the seen token stays first
    state = (counts.to(device), seen_mask.to(device), rows)
    meta = build_sampling_metadata(params, {}, vocab, torch.device(device), penalty_tensors=state, use_kernel=True)
    assert penalties_on_load(meta) is not None
    on_load = Sampler()(logits.to(device), meta).token_ids.cpu()
    assert on_load.tolist() == unseen[:4].tolist() + [int(seen[4])]
    through_pass = dataclasses.replace(meta, logit_mask=torch.zeros(5, vocab, device=device))
    assert penalties_on_load(through_pass) is None
    assert torch.equal(Sampler()(logits.to(device), through_pass).token_ids.cpu(), on_load)

    penalised = apply_penalties(logits.float(), counts[rows], seen_mask[rows],
                                torch.tensor([p.repetition_penalty for p in params]),
                                torch.tensor([p.frequency_penalty for p in params]),
                                torch.tensor([p.presence_penalty for p in params]))
    temperature, seeds = meta.draw_temperature.cpu(), meta.seeds.cpu()
    assert on_load[1] == categorical_draw_ref(penalised[1:2], temperature[1:2], seeds[1:2])[0]
    nucleus = top_p_draw_ref(penalised, temperature, torch.tensor([1.0, 1.0, 0.6, 1.0, 0.9]), seeds)
    assert on_load[2] == nucleus[2] and on_load[4] == nucleus[4]
