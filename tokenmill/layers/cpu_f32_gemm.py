"""float32 linear layers on CPUs with AVX-512, from weights packed once into panels of 64 output features.

oneDNN's prepacked float32 GEMM (layers.cpu_gemm) is near the CPU's peak on a prefill's 512 rows but not on a decode
step's few dozen: on the 2-core AMD EPYC (Zen 5) the default model's qkv, o and down projections ran at 310-340
GFLOP/s at 64 rows, where the cores multiply ~500. The kernel here is the textbook register-blocked one: the weight
is laid out as panels [K][64 features], read as one sequential stream per thread (the next panel prefetched into L2
while the first rows take the current one), and a micro-kernel keeps 6 rows x 64 features of sums in 24 registers,
one FMA per input per register. The threads share (panel, 6-row block) units in panel order, so every thread gets
the same work whatever the panel count (9 panels of o or down: no thread waits on a fifth), and rows go by chunks
of 192 so that many rows do not push each other out of the caches.

Measured against oneDNN on that CPU (30 default-model layers of each shape, distinct weights, 2 threads): 1.14x at 1
row, 1.10x at 8, 1.09-1.11x at 64 (qkv and o 1.3x), level to 1.03x from 256 to 2,048 rows (BENCHMARKS.md, issue
23). Each output is a sum over the inputs in their order with one fused multiply-add each (the bias added last), so
a row's result does not depend on the other rows of its batch.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from typing import NamedTuple

import torch

from tokenmill.cpu_compile import build_error_message, compile_library, cpu_flags

logger = logging.getLogger(__name__)

PANEL = 64
"""Output features per panel (4 AVX-512 registers of float32)."""

_SOURCE = r"""
#include <stdint.h>
#include <immintrin.h>
#include <omp.h>

#define NR 64            /* features per panel */
#define MR 6             /* rows per micro-kernel call: 6 x 4 registers of sums */
#define CHUNK_BLOCKS 32  /* row blocks (of MR) whose activations stay cached while every panel passes */

/* w [N, K] -> [ceil(N / NR)][K][NR], features past N zero. */
void f32_pack(float *dst, const float *w, int64_t N, int64_t K, int num_threads) {
    const int64_t panels = (N + NR - 1) / NR;
    _Pragma("omp parallel for num_threads(num_threads) if (num_threads > 1 && panels > 8)")
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < K; k++)
            for (int j = 0; j < NR; j++) {
                const int64_t n = p * NR + j;
                dst[(p * K + k) * NR + j] = n < N ? w[n * K + k] : 0.0f;
            }
}

/* y[r, 0:cols] = x[r, :] . panel b (+ bias) for `rows` rows; `next` (or NULL): the panel to prefetch into L2 */
static inline __attribute__((always_inline)) void micro(const int rows, const float *x, int64_t ldx,
        const float *b, int64_t K, float *y, int64_t ldy, int cols, const float *bias, const float *next) {
    __m512 c[MR][4];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < 4; j++) c[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        if (next)
            for (int j = 0; j < NR; j += 16) _mm_prefetch((const char *)(next + k * NR + j), _MM_HINT_T1);
        const __m512 b0 = _mm512_loadu_ps(b + k * NR), b1 = _mm512_loadu_ps(b + k * NR + 16);
        const __m512 b2 = _mm512_loadu_ps(b + k * NR + 32), b3 = _mm512_loadu_ps(b + k * NR + 48);
        for (int r = 0; r < rows; r++) {
            const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
            c[r][0] = _mm512_fmadd_ps(a, b0, c[r][0]);
            c[r][1] = _mm512_fmadd_ps(a, b1, c[r][1]);
            c[r][2] = _mm512_fmadd_ps(a, b2, c[r][2]);
            c[r][3] = _mm512_fmadd_ps(a, b3, c[r][3]);
        }
    }
    for (int j = 0; j < 4; j++) {
        const int left = cols - j * 16;
        if (left <= 0) break;
        const __mmask16 mask = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + j * 16) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++)
            _mm512_mask_storeu_ps(y + r * ldy + j * 16, mask, bias ? _mm512_add_ps(c[r][j], bv) : c[r][j]);
    }
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ w.T (+ bias), w packed by f32_pack */
void f32_linear(float *y, int64_t ldy, const float *x, int64_t ldx, const float *wp, const float *bias,
                int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t panels = (N + NR - 1) / NR, all_blocks = (M + MR - 1) / MR;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t c0 = 0; c0 < all_blocks; c0 += CHUNK_BLOCKS) {
            const int64_t blocks = all_blocks - c0 < CHUNK_BLOCKS ? all_blocks - c0 : CHUNK_BLOCKS;
            /* a thread's share: a run of (panel, row block) units in panel order, its weights one stream */
            const int64_t units = panels * blocks, u0 = units * t / nt, u1 = units * (t + 1) / nt;
            const int64_t last_panel = u1 > u0 ? (u1 - 1) / blocks : -1;
            for (int64_t u = u0; u < u1; u++) {
                const int64_t p = u / blocks, m = (c0 + u % blocks) * MR;
                const float *b = wp + p * K * NR;
                /* the panel's first rows here stream the thread's next panel in */
                const float *next = (u % blocks == 0 || u == u0) && p < last_panel ? b + K * NR : 0;
                const int cols = N - p * NR < NR ? (int)(N - p * NR) : NR;
                const float *pb = bias ? bias + p * NR : 0;
                const int rows = M - m < MR ? (int)(M - m) : MR;
                float *yy = y + m * ldy + p * NR;
                const float *xx = x + m * ldx;
                switch (rows) {  /* a constant row count: the sums stay in registers */
                    case 6: micro(6, xx, ldx, b, K, yy, ldy, cols, pb, next); break;
                    case 5: micro(5, xx, ldx, b, K, yy, ldy, cols, pb, next); break;
                    case 4: micro(4, xx, ldx, b, K, yy, ldy, cols, pb, next); break;
                    case 3: micro(3, xx, ldx, b, K, yy, ldy, cols, pb, next); break;
                    case 2: micro(2, xx, ldx, b, K, yy, ldy, cols, pb, next); break;
                    default: micro(1, xx, ldx, b, K, yy, ldy, cols, pb, next); break;
                }
            }
        }
    }
}
"""


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """The library where the CPU has AVX-512 and the compiler builds it, else None (oneDNN serves float32)."""
    if "avx512f" not in cpu_flags():
        return None
    try:
        lib = compile_library("f32_gemm", _SOURCE)
    except (OSError, subprocess.CalledProcessError) as error:
        logger.warning("CPU: the float32 GEMM could not be built (%s); float32 linears use oneDNN",
                       build_error_message(error))
        return None
    lib.f32_pack.restype = None
    lib.f32_pack.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    lib.f32_linear.restype = None
    lib.f32_linear.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
                               + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_int])
    return lib


class F32Panels(NamedTuple):
    """A float32 weight [out_features, in_features] as f32_pack lays it out: panels [K][64 features]."""

    packed: torch.Tensor
    out_features: int
    in_features: int


def f32_applies(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and load_kernel() is not None)


def pack_f32(weight: torch.Tensor) -> F32Panels:
    """The weight reordered for f32_linear; check f32_applies() first."""
    n, k = weight.shape
    weight = weight.detach().contiguous()
    packed = torch.empty((n + PANEL - 1) // PANEL * PANEL * k, dtype=torch.float32)
    load_kernel().f32_pack(packed.data_ptr(), weight.data_ptr(), n, k, torch.get_num_threads())
    return F32Panels(packed, n, k)


def f32_linear(x: torch.Tensor, weight: F32Panels, bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, k] float32 @ weight.T (+ bias) -> [m, n] float32."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    m = x.shape[0]
    y = torch.empty((m, weight.out_features), dtype=torch.float32)
    load_kernel().f32_linear(y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), weight.packed.data_ptr(),
                             None if bias is None else bias.data_ptr(), m, weight.out_features,
                             weight.in_features, torch.get_num_threads())
    return y
