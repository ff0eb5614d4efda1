"""Each sampler kernel alone at batch 256 over Qwen3's 151,936-token vocabulary (GPU), with layout variants.

    python3 benchmarks/sampler_kernels.py

Times are GPU kernel time per call (torch profiler), after a warm-up; the logits are random (scale 3), so the
top-p redraw rounds see a flat-ish distribution, as dummy-weight models give.
"""

from __future__ import annotations

import functools

import torch
import triton

from tokenmill.kernels import sampling
from tokenmill.kernels.penalties import Penalties, apply_penalties_fused
from tokenmill.kernels.sampling_floor import candidate_floor

ROWS, VOCAB = 256, 151936


def time_ms(fn, repeats: int = 10) -> float:
    """GPU time of one call: the sum of its kernels' times (torch profiler), so that the host's launch
    overhead, which CUDA events around a lone call would include, does not count."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / repeats / 1e3


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[tuple[str, float]] = []
    bf16 = (torch.randn(ROWS, VOCAB, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    fp32 = bf16.float()
    seeds = torch.randint(0, 2**62, (ROWS,), device="cuda", generator=gen)
    zeros, ones = torch.zeros(ROWS, device="cuda"), torch.full((ROWS,), 0.8, device="cuda")
    top_p = torch.full((ROWS,), 0.95, device="cuda")
    top_k = torch.full((ROWS,), 50, dtype=torch.int64, device="cuda")
    min_p = torch.full((ROWS,), 0.05, device="cuda")
    bytes_bf16 = ROWS * VOCAB * 2
    rows.append(("copy of the bf16 logits (bandwidth reference)", time_ms(lambda: bf16.clone())))
    rows.append(("torch argmax bf16", time_ms(lambda: bf16.argmax(-1))))
    rows.append(("greedy_argmax bf16", time_ms(lambda: sampling.greedy_argmax(bf16))))
    rows.append(("torch topk(50) bf16", time_ms(lambda: bf16.topk(50, dim=-1))))
    for name, logits in (("bf16", bf16), ("fp32", fp32)):
        for label, temperature in (("greedy rows", zeros), ("T=0.8", ones)):
            for num_warps in (2, 4, 8):
                draw = functools.partial(sampling.categorical_draw, logits, temperature, seeds, num_warps=num_warps)
                rows.append((f"categorical_draw {name} {label}, {num_warps} warps", time_ms(draw)))
    for tiles_per_split in (2, 3, 10):  # the default layout: 5 tiles per split at this vocabulary
        rows.append((f"  categorical_draw bf16 T=0.8, {tiles_per_split} tiles/split", time_ms(functools.partial(
            sampling.categorical_draw, bf16, ones, seeds, tiles_per_split=tiles_per_split))))
    rows.append(("top_p_draw bf16 T=0.8 p=0.95", time_ms(lambda: sampling.top_p_draw(bf16, ones, top_p, seeds))))
    rows.append(("top_p_draw fp32 T=0.8 p=0.95", time_ms(lambda: sampling.top_p_draw(fp32, ones, top_p, seeds))))
    rows.append(("candidate_floor bf16 top_k=50", time_ms(lambda: candidate_floor(bf16, ones, top_k, None))))
    for k in (1000, 1024):
        rows.append((f"candidate_floor bf16 top_k={k}", time_ms(
            functools.partial(candidate_floor, bf16, ones, torch.full_like(top_k, k), None))))
    for bits in (4, 8):
        rows.append((f"candidate_floor bf16 top_k=50, radix only, {bits}-bit digits", time_ms(
            functools.partial(candidate_floor, bf16, ones, top_k, None, digit_bits=bits, fast_top_k=False))))
    rows.append(("candidate_floor fp32 top_k=50", time_ms(lambda: candidate_floor(fp32, ones, top_k, None))))
    rows.append(("candidate_floor bf16 min_p", time_ms(lambda: candidate_floor(bf16, ones, None, min_p))))
    state_rows = torch.arange(ROWS, device="cuda")
    penalty = torch.full((ROWS,), 1.1, device="cuda")
    for seen_tokens in (2048, VOCAB // 2):  # a 2k-token context; every other token seen (the worst case)
        seen_ids = torch.randint(0, VOCAB, (ROWS, seen_tokens), device="cuda", generator=gen)
        counts = torch.zeros(ROWS, VOCAB, dtype=torch.int32, device="cuda").scatter_(1, seen_ids, 1)
        seen_mask = counts.bool()
        reference = apply_penalties_fused(bf16, None, state_rows, counts, seen_mask, penalty, zeros, zeros)
        for num_warps in (4, 2, 8):
            run = functools.partial(apply_penalties_fused, bf16, None, state_rows, counts, seen_mask, penalty, zeros,
                                    zeros, num_warps=num_warps)
            same = all(torch.equal(a, b) for a, b in zip(run(), reference))
            rows.append((f"apply_penalties_fused bf16 -> fp32, {seen_tokens} seen, {num_warps} warps"
                         f"{'' if same else ' (OUTPUT DIFFERS)'}", time_ms(run)))
        penalties = Penalties(state_rows, counts, seen_mask, penalty, zeros, zeros)
        rows.append((f"categorical_draw bf16 T=0.8, penalties on load, {seen_tokens} seen", time_ms(
            functools.partial(sampling.categorical_draw, bf16, ones, seeds, penalties=penalties))))
        rows.append((f"top_p_draw bf16 T=0.8 p=0.95, penalties on load, {seen_tokens} seen", time_ms(
            functools.partial(sampling.top_p_draw, bf16, ones, top_p, seeds, penalties=penalties))))
        rows.append((f"split_maxima bf16, penalties on load, {seen_tokens} seen", time_ms(
            functools.partial(sampling.split_maxima, bf16, penalties))))
    print(f"\n{ROWS} x {VOCAB}, {torch.cuda.get_device_name()}, triton {triton.__version__}")
    for name, ms in rows:
        print(f"{name:<52}{ms * 1e3:>9.1f} us   {bytes_bf16 / ms / 1e9:>7.2f} TB/s of bf16 logits")


if __name__ == "__main__":
    main()
