"""The draw on the CPU as one C kernel: inverse CDF, one uniform per row against the running sum of exp(z - max) in
token-id order (the Triton kernels' method), with min_p, and top_p by the Triton kernels' rejection rounds (no sort).
torch's way, argmax of probs / Exp(1) noise, draws one exponential per vocabulary entry (11.3 ms for 16 x 49,152 on
one core of the 2-core EPYC, against 0.31 ms here) and sorts every row for top_p: the default model sampled at
0.72x its greedy speed at batch 16, 0.45x with top_p 0.9 (BENCHMARKS.md, CPU section); now at it.

Rows hold temperature-scaled logits with -inf where a token is out (min_p, top_k, top_p, masks): such a token's
weight is exactly 0 and is never drawn. Weights below exp(-86) of the row's largest are 0 too (a float32 softmax
loses them likewise). Sums are in float64 (over 8 lanes, then blocks of 256 before the block that holds the target
is walked token by token), so a row given as its candidates in token-id order (the top-k path) draws the same token
as the whole row for the same uniform, up to float64 rounding. A row with +inf logits (a penalty or the temperature
overflowed) draws among those alone, as the argmax takes the first of them; a row with no finite logit, or a NaN,
answers token 0.
`load_kernel()` is None where no compiler works: the sampler then draws with torch.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill.cpu_compile import compile_or_none

_SOURCE = r"""
#include <float.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef union { int32_t i; float f; } bits32;

/* exp(z) for z <= 0 as 2^n 2^f (f in [-0.5, 0.5], 2^f by its Taylor series to degree 7: relative error < 1e-8
   before float32 rounding); 0 where z < -86 (exp(-86) is still a normal float), for -inf and NaN. Integer masks
   rather than branches, so that the loop vectorizes (gcc if-converts one float select per loop, not two). */
static inline float weight(float z) {
    const int32_t keep = -(int32_t)(z >= -86.0f);  /* all ones where kept */
    bits32 clamped = {.f = z}, lowest = {.f = -86.0f}, scale;
    clamped.i = (clamped.i & keep) | (lowest.i & ~keep);
    const float t = clamped.f * 1.44269504088896341f;  /* z log2(e), >= -124.1 */
    const int32_t n = (int32_t)(t - 0.5f);  /* t <= 0: the nearest integer */
    const float f = t - (float)n;
    float p = 1.525273380405984e-05f;
    p = p * f + 1.5403530393381606e-04f;
    p = p * f + 1.3333558146428443e-03f;
    p = p * f + 9.618129107628477e-03f;
    p = p * f + 5.550410866482158e-02f;
    p = p * f + 2.402265069591007e-01f;
    p = p * f + 6.931471805599453e-01f;
    p = p * f + 1.0f;
    scale.i = ((n + 127) << 23) & keep;  /* 2^n, or +0 */
    return p * scale.f;
}

/* The sum of the weights above `floor` in w[0..n), in float64 over 8 lanes (vectorized). */
static double sum_above(const float *w, int64_t n, float floor) {
    double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int k = 0; k < 8; k++) lanes[k] += w[j + k] * (float)(w[j + k] > floor);  /* no select: it vectorizes */
    double sum = 0.0;
    for (; j < n; j++) sum += w[j] > floor ? w[j] : 0.0f;
    for (int k = 0; k < 8; k++) sum += lanes[k];
    return sum;
}

#define BLOCK 256

/* The token where the running sum of the weights above `floor` passes `target`: whole blocks while it stays at or
   below, then token by token; -1 if there is no such weight. */
static int64_t inverse_cdf(const float *w, int64_t n, float floor, double target) {
    double sum = 0.0;
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t size = n - start < BLOCK ? n - start : BLOCK;
        const double block = sum_above(w + start, size, floor);
        if (sum + block <= target) {
            sum += block;
            continue;
        }
        for (int64_t j = start; j < start + size; j++) {
            if (w[j] > floor && w[j] > 0.0f) {
                sum += w[j];
                if (sum > target) return j;
            }
        }
    }
    for (int64_t j = n - 1; j >= 0; j--)  /* the sums' rounding left the target above them: the last token in */
        if (w[j] > floor && w[j] > 0.0f) return j;
    return -1;
}

/* One row: min_p, then a draw by inverse CDF with u[0]; with top_p < 1, rejection rounds as the Triton kernels'
   (a draw whose strictly more likely tokens hold top_p of the mass or more is outside the nucleus, as is every token
   at most as likely: redraw among those above it with the next uniform), at most `max_draws` redraws, then the
   argmax. */
static int64_t draw_row(const float *x, int64_t n, float top, const double *u, float min_p, float top_p,
                        int max_draws, float *w) {
    if (top > FLT_MAX)  /* +inf logits (an overflow: certain) are in alone, equally likely (inf - inf is NaN) */
        for (int64_t j = 0; j < n; j++) w[j] = x[j] == top ? 1.0f : 0.0f;
    else
        for (int64_t j = 0; j < n; j++) w[j] = weight(x[j] - top);
    if (min_p > 0.0f)  /* out below min_p times the largest probability (whose weight is 1) */
        for (int64_t j = 0; j < n; j++) w[j] = w[j] >= min_p ? w[j] : 0.0f;
    const double total = sum_above(w, n, -1.0f);
    int64_t token = total > 0.0 ? inverse_cdf(w, n, -1.0f, u[0] * total) : -1;
    if (token < 0) return 0;  /* no finite logit (a NaN top: every weight 0) */
    for (int k = 1; top_p < 1.0f; k++) {
        const double above = sum_above(w, n, w[token]);
        if (above < (double)top_p * total) return token;
        if (k > max_draws) {
            int64_t best = 0;
            for (int64_t j = 1; j < n; j++) best = w[j] > w[best] ? j : best;
            return best;
        }
        const int64_t redrawn = inverse_cdf(w, n, w[token], u[k] * above);
        if (redrawn < 0) return token;  /* nothing above it after all (rounding) */
        token = redrawn;
    }
    return token;
}

/* out[r]: the token drawn in row r of x (rows x n floats, `stride` apart; top[r] its largest value) with the
   uniforms u[r * u_stride ...] in [0, 1) (1 + max_draws of them where top_p[r] < 1); min_p, top_p: NULL for none;
   `scratch`: n floats per thread. */
void draw_rows(int64_t *out, const float *x, const float *top, const double *u, int64_t u_stride,
               const float *min_p, const float *top_p, int max_draws, int64_t rows, int64_t n, int64_t stride,
               float *scratch, int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) if (num_threads > 1 && rows > 1)")
    for (int64_t r = 0; r < rows; r++) {
#ifdef _OPENMP
        const int thread = omp_get_thread_num();
#else
        const int thread = 0;
#endif
        out[r] = draw_row(x + r * stride, n, top[r], u + r * u_stride, min_p ? min_p[r] : 0.0f,
                          top_p ? top_p[r] : 1.0f, max_draws, scratch + (int64_t)thread * n);
    }
}
"""


MAX_DRAWS = 64
"""Top-p redraws before the argmax is taken (as kernels/sampling.py's MAX_DRAWS)."""


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    lib = compile_or_none("draw", _SOURCE, "CPU draw: the C kernel", "drawing with torch (exponential noise)")
    if lib is None:
        return None
    lib.draw_rows.restype = None
    lib.draw_rows.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
                              + [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int])
    return lib


def draw_applies(logits: torch.Tensor) -> bool:
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and logits.shape[1] > 0 and load_kernel() is not None)


def row_uniforms(num_rows: int, generators: dict[int, torch.Generator], top_p: torch.Tensor | None) -> torch.Tensor:
    """[num_rows, 1 or 1 + MAX_DRAWS] float64 uniforms in [0, 1) for `draw_rows`. A seeded row's come from its own
    generator, as many as its own draw may read, so that its tokens do not depend on the rest of the batch."""
    uniforms = torch.rand(num_rows, 1 if top_p is None else 1 + MAX_DRAWS, dtype=torch.float64)
    for row, generator in generators.items():
        reads = 1 + MAX_DRAWS if top_p is not None and float(top_p[row]) < 1 else 1
        uniforms[row, :reads] = torch.rand(reads, dtype=torch.float64, generator=generator)
    return uniforms


def draw_rows(logits: torch.Tensor, uniforms: torch.Tensor, top_p: torch.Tensor | None = None,
              min_p: torch.Tensor | None = None) -> torch.Tensor:
    """[rows] int64: each row's token drawn by inverse CDF (`uniforms` [rows, 1 or more] float64 in [0, 1), one per
    draw: `row_uniforms`), among the tokens at least `min_p` [rows] times as likely as its most likely (0: all), and
    within its top-p nucleus of those if `top_p` [rows] is given (1: the whole row). `logits` [rows, n] float32,
    temperature-scaled, -inf where a token is out. Check draw_applies() first."""
    rows, n = logits.shape
    uniforms = uniforms.to(torch.float64).reshape(rows, -1).contiguous()
    assert top_p is None or uniforms.shape[1] == 1 + MAX_DRAWS, "top-p draws need 1 + MAX_DRAWS uniforms a row"
    top = logits.amax(dim=-1)  # NaN where the row has one: every weight is then 0 (token 0)
    top_p, min_p = (None if p is None else p.to(torch.float32).contiguous() for p in (top_p, min_p))
    num_threads = min(torch.get_num_threads(), max(rows, 1))
    scratch = torch.empty(num_threads * n, dtype=torch.float32)
    out = torch.empty(rows, dtype=torch.int64)
    load_kernel().draw_rows(out.data_ptr(), logits.data_ptr(), top.data_ptr(), uniforms.data_ptr(), uniforms.stride(0),
                            *(None if p is None else p.data_ptr() for p in (min_p, top_p)), MAX_DRAWS, rows, n,
                            logits.stride(0), scratch.data_ptr(), num_threads)
    return out
