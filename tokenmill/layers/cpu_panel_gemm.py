"""float32 and bfloat16 linear layers on CPUs with AVX-512, from weights packed once into panels of 64 features.

oneDNN's prepacked GEMM (layers.cpu_gemm) is near the CPU's peak on a prefill's 512 rows but not on a decode step's
few dozen: on the 2-core AMD EPYC (Zen 5) the default model's qkv, o and down projections ran at 310-340 GFLOP/s
in float32 at 64 rows, where the cores multiply ~500, and at 580-680 in bfloat16, where they multiply ~1,000. The
kernel here is the textbook register-blocked one: the weight is laid out as panels [K][64 features] (bfloat16:
[K / 2][64][2], the input pairs AVX512_BF16's dot product takes), read as one sequential stream per thread (the
next panel prefetched into L2 while the first rows take the current one), and a micro-kernel keeps 6 rows x 64
features of float32 sums in 24 registers. The threads share (panel, 6-row block) units in panel order, so every
thread gets the same work whatever the panel count (9 panels of o or down: no thread waits on a fifth), and rows
go by chunks of 192 so that many rows do not push each other out of the caches.

Measured against oneDNN on that CPU (30 default-model layers of each shape, distinct weights, 2 threads), float32:
1.14x at 1 row, 1.10x at 8, 1.09-1.11x at 64, level to 1.03x from 256 to 2,048 rows; bfloat16: 1.56x at 8 rows,
1.23x at 64, 1.14x at 128, level at 2,048 (BENCHMARKS.md, issue 23). float32 sums one fused multiply-add per input
in the inputs' order; bfloat16 adds exact products of input pairs; the bias joins in float32 before the output's
one rounding. Either way a row's result does not depend on the other rows of its batch. CPUs with AMX take
bfloat16 weights into layers.cpu_amx_gemm's tiles instead.
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from tokenmill.cpu_compile import compile_or_none, cpu_flags

PANEL = 64
"""Output features per panel (4 AVX-512 registers of float32 sums)."""

_SOURCE = r"""
#include <stdint.h>
#include <immintrin.h>
#include <omp.h>

#define NR 64            /* features per panel */
#define MR 6             /* rows per micro-kernel call: 6 x 4 registers of sums */
#define CHUNK_BLOCKS 32  /* row blocks (of MR) whose activations stay cached while every panel passes */

/* w [N, K] -> float32 [ceil(N / NR)][K][NR], or bfloat16 (K even) [ceil(N / NR)][K / 2][NR][2]; features past N
   zero. Either way [panel][K32][NR] of 32-bit units, K32 units a row: a float32, or a bfloat16 input pair (the
   order the dot product takes). Each feature's row is read in order (the panel, written with a stride, stays in L2). */
void panel_pack(uint32_t *dst, const uint32_t *w, int64_t N, int64_t K32, int num_threads) {
    const int64_t panels = (N + NR - 1) / NR;
    _Pragma("omp parallel for num_threads(num_threads) if (num_threads > 1 && panels > 8)")
    for (int64_t p = 0; p < panels; p++)
        for (int j = 0; j < NR; j++) {
            const int64_t n = p * NR + j;
            uint32_t *d = dst + p * K32 * NR + j;
            for (int64_t k = 0; k < K32; k++) d[k * NR] = n < N ? w[n * K32 + k] : 0;
        }
}

/* The sums (+ bias) of `rows` rows x `cols` features to y: float32, or bfloat16 rounded to nearest even */
static inline __attribute__((always_inline)) void store(const int rows, __m512 c[MR][4], void *y, int64_t ldy,
                                                        int out_f32, int cols, const float *bias) {
    for (int j = 0; j < 4; j++) {
        const int left = cols - j * 16;
        if (left <= 0) break;
        const __mmask16 mask = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + j * 16) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const __m512 v = bias ? _mm512_add_ps(c[r][j], bv) : c[r][j];
            if (out_f32) _mm512_mask_storeu_ps((float *)y + r * ldy + j * 16, mask, v);
#ifdef __AVX512BF16__  /* bfloat16 output only comes from bfloat16 inputs */
            else _mm256_mask_storeu_epi16((uint16_t *)y + r * ldy + j * 16, mask, (__m256i)_mm512_cvtneps_pbh(v));
#endif
        }
    }
}

/* `rows` rows of x against one panel b; `next` (or NULL): the panel to prefetch into L2 meanwhile */
static inline __attribute__((always_inline)) void micro_f32(const int rows, const float *x, int64_t ldx,
        const float *b, int64_t K, void *y, int64_t ldy, int out_f32, int cols, const float *bias, const float *next) {
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
    store(rows, c, y, ldy, out_f32, cols, bias);
}

#ifdef __AVX512BF16__
static inline __attribute__((always_inline)) void micro_bf16(const int rows, const uint16_t *x, int64_t ldx,
        const uint16_t *b, int64_t K, void *y, int64_t ldy, int out_f32, int cols, const float *bias,
        const uint16_t *next) {
    __m512 c[MR][4];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < 4; j++) c[r][j] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < K / 2; kp++) {
        const uint16_t *bk = b + kp * NR * 2;
        if (next)
            for (int j = 0; j < NR * 2; j += 32) _mm_prefetch((const char *)(next + kp * NR * 2 + j), _MM_HINT_T1);
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bk), b1 = (__m512bh)_mm512_loadu_si512(bk + 32);
        const __m512bh b2 = (__m512bh)_mm512_loadu_si512(bk + 64), b3 = (__m512bh)_mm512_loadu_si512(bk + 96);
        for (int r = 0; r < rows; r++) {
            int32_t two;  /* inputs 2kp and 2kp + 1 of row r, as one 32-bit lane */
            __builtin_memcpy(&two, x + r * ldx + 2 * kp, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(two);
            c[r][0] = _mm512_dpbf16_ps(c[r][0], a, b0);
            c[r][1] = _mm512_dpbf16_ps(c[r][1], a, b1);
            c[r][2] = _mm512_dpbf16_ps(c[r][2], a, b2);
            c[r][3] = _mm512_dpbf16_ps(c[r][3], a, b3);
        }
    }
    store(rows, c, y, ldy, out_f32, cols, bias);
}
#endif

/* y [M, N] (row stride ldy; float32, or bfloat16 unless out_f32) = x [M, K] (row stride ldx) @ w.T (+ bias float32),
   w packed by panel_pack (x float32, or bfloat16 with `bf16` set) */
static void panel_linear(void *y, int64_t ldy, int out_f32, const void *x, int64_t ldx, const void *wp,
                         const float *bias, int64_t M, int64_t N, int64_t K, int bf16, int num_threads) {
    const int64_t panels = (N + NR - 1) / NR, all_blocks = (M + MR - 1) / MR, out_size = out_f32 ? 4 : 2;
    const int64_t in_size = bf16 ? 2 : 4;
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
                const char *b = (const char *)wp + p * K * NR * in_size;
                /* the panel's first rows here stream the thread's next panel in */
                const char *next = (u % blocks == 0 || u == u0) && p < last_panel ? b + K * NR * in_size : 0;
                const int cols = N - p * NR < NR ? (int)(N - p * NR) : NR;
                const float *pb = bias ? bias + p * NR : 0;
                const int rows = M - m < MR ? (int)(M - m) : MR;
                char *yy = (char *)y + (m * ldy + p * NR) * out_size;
                const char *xx = (const char *)x + m * ldx * in_size;
#define ROWS(R) \
                if (bf16) BF16_CALL(R) \
                else micro_f32(R, (const float *)xx, ldx, (const float *)b, K, yy, ldy, out_f32, cols, pb, \
                               (const float *)next);
#ifdef __AVX512BF16__
#define BF16_CALL(R) micro_bf16(R, (const uint16_t *)xx, ldx, (const uint16_t *)b, K, yy, ldy, out_f32, cols, pb, \
                                (const uint16_t *)next);
#else
#define BF16_CALL(R) {}
#endif
                switch (rows) {  /* a constant row count: the sums stay in registers */
                    case 6: ROWS(6) break;
                    case 5: ROWS(5) break;
                    case 4: ROWS(4) break;
                    case 3: ROWS(3) break;
                    case 2: ROWS(2) break;
                    default: ROWS(1) break;
                }
            }
        }
    }
}

/* float32 in, float32 out: out_f32 is there for bf16_linear's signature only */
void f32_linear(float *y, int64_t ldy, int out_f32, const float *x, int64_t ldx, const float *wp, const float *bias,
                int64_t M, int64_t N, int64_t K, int num_threads) {
    (void)out_f32;
    panel_linear(y, ldy, 1, x, ldx, wp, bias, M, N, K, 0, num_threads);
}

void bf16_linear(void *y, int64_t ldy, int out_f32, const uint16_t *x, int64_t ldx, const uint16_t *wp,
                 const float *bias, int64_t M, int64_t N, int64_t K, int num_threads) {
    panel_linear(y, ldy, out_f32, x, ldx, wp, bias, M, N, K, 1, num_threads);
}

int bf16_built(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}
"""


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """The library where the CPU has AVX-512 and the compiler builds it, else None (oneDNN serves the linears)."""
    if "avx512f" not in cpu_flags():
        return None
    lib = compile_or_none("panel_gemm", _SOURCE, "CPU: the AVX-512 GEMM", "linears use oneDNN")
    if lib is None:
        return None
    lib.panel_pack.restype = None
    lib.panel_pack.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    for dtype in ("f32", "bf16"):
        getattr(lib, f"{dtype}_linear").restype = None
        getattr(lib, f"{dtype}_linear").argtypes = (
            [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 2
            + [ctypes.c_int64] * 3 + [ctypes.c_int])
    lib.bf16_built.restype = ctypes.c_int
    lib.bf16_built.argtypes = []
    return lib


class PanelWeight(NamedTuple):
    """A weight [out_features, in_features] as the kernel lays it out (float32 or bfloat16 panels)."""

    packed: torch.Tensor
    out_features: int
    in_features: int


def panel_applies(weight: torch.Tensor) -> bool:
    """float32 weights on CPUs with AVX-512; bfloat16 ones (an even in_features) where the CPU also has AVX512_BF16."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    lib = load_kernel()
    if lib is None:
        return False
    return weight.dtype == torch.float32 or (weight.shape[1] % 2 == 0 and bool(lib.bf16_built()))


def pack_panels(weight: torch.Tensor) -> PanelWeight:
    """The weight reordered for panel_linear; check panel_applies() first."""
    n, k = weight.shape
    weight = weight.detach().contiguous()
    packed = torch.empty((n + PANEL - 1) // PANEL * PANEL * k, dtype=weight.dtype)
    units_per_row = k * weight.element_size() // 4  # float32s, or bfloat16 pairs
    load_kernel().panel_pack(packed.data_ptr(), weight.data_ptr(), n, units_per_row, torch.get_num_threads())
    return PanelWeight(packed, n, k)


def panel_linear(x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None,
                 out_float32: bool = False) -> torch.Tensor:
    """x [m, k] (the weight's dtype) @ weight.T (+ bias) -> [m, n] in x's dtype, or float32 where `out_float32`."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    out_dtype = torch.float32 if out_float32 else x.dtype
    m = x.shape[0]
    y = torch.empty((m, weight.out_features), dtype=out_dtype)
    linear = load_kernel().f32_linear if x.dtype == torch.float32 else load_kernel().bf16_linear
    linear(y.data_ptr(), y.stride(0), out_dtype == torch.float32, x.data_ptr(), x.stride(0), weight.packed.data_ptr(),
           None if bias is None else bias.data_ptr(), m, weight.out_features, weight.in_features,
           torch.get_num_threads())
    return y
