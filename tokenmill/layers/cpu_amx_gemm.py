"""bfloat16 linear layers on CPUs with AMX, from weights packed once into the tiles the multiply reads.

A decode step of a few dozen rows reads every weight once and multiplies little: memory decides its time. oneDNN's
bfloat16 GEMM (layers.cpu_gemm) streams the default model's weights at ~11-15 GB/s on the 2-core Xeon, where the two
cores read ~24 GB/s. Here each weight is reordered at load into AMX's operand layout, 32 output features by 32
inputs per 2 KiB run, so that a thread reads its features' weights as one sequential stream (prefetched ahead),
and the activations are the other operand as they lie in memory (rows of x, 16 at a time). C tiles are
16 rows x 16 features in float32; the output is written in bfloat16 (round to nearest even) or float32 (the LM
head's logits, which the sampler takes in float32: no conversion pass). Products are exact, sums float32 in
the tiles' order, so the result differs from oneDNN's only by the order of the float32 sums.

Served where the CPU has AMX (and Linux grants it) and the weight is bfloat16 with K a multiple of 32 (elsewhere
layers.cpu_gemm's oneDNN path), for every row count: against oneDNN on the 2-core Xeon, per default-model step of
30 layers, 1.3x at 5-16 rows, 1.1-1.3x at 33-64, level from 128 to 512 (the CPU's token budget), 0.7-0.9x at
2,048 rows, where oneDNN's blocking reuses weight tiles over more rows (BENCHMARKS.md, issue 23).

GGUF Q4_0 and Q4_1 weights are also read kept 4-bit (amx_pack_q4): each thread decodes its strip of 32 features
into bfloat16 tiles in L1/L2 and multiplies those, a third of the bytes from memory for ~0.4 instructions a weight
of decoding; the decoded values are the dense bfloat16 copy's, so the results are the same bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch
from gguf import GGMLQuantizationType

from tokenmill.cpu_compile import AMX_C, compile_or_none, cpu_flags

# GGML types the kernel reads kept quantized, and a dense weight's marker (as layers.quant.gguf's DENSE)
Q4_0, Q4_1 = int(GGMLQuantizationType.Q4_0), int(GGMLQuantizationType.Q4_1)
Q4_TYPES = (Q4_0, Q4_1)
DENSE = -1
Q4_HALF_BYTES = 320
"""Bytes of 16 features x 32 inputs in amx_pack_q4's form: 16 fp16 scales, 16 fp16 minimums, 256 nibble bytes."""

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
""" + AMX_C + r"""
#define BLOCK_GROUPS 16  /* rows (in groups of 16) that take each strip's weights while they are in L1 or L2: many
                            rows go by blocks, which read the weights again each, not the rows for every strip */
#define PREFETCH_AHEAD 4096  /* bytes of a thread's weight stream ahead of the tiles being read (measured best) */

/* w [N, K] bfloat16 -> [ceil(N / 32)][K / 32][2][16 input pairs][16 features][2]: B tiles of 16 features each,
   features past N zero. */
void amx_pack(uint16_t *dst, const uint16_t *w, int64_t N, int64_t K, int num_threads) {
    const int64_t strips = (N + 31) / 32, steps = K / 32;
    _Pragma("omp parallel for num_threads(num_threads) if (num_threads > 1 && strips > 8)")
    for (int64_t s = 0; s < strips; s++)
        for (int64_t kk = 0; kk < steps; kk++)
            for (int h = 0; h < 2; h++) {
                uint16_t *tile = dst + ((s * steps + kk) * 2 + h) * 512;
                for (int n = 0; n < 16; n++) {
                    const int64_t feature = s * 32 + h * 16 + n;
                    for (int i = 0; i < 32; i++)
                        tile[(i / 2 * 16 + n) * 2 + i % 2] = feature < N ? w[feature * K + kk * 32 + i] : 0;
                }
            }
}

static inline void store_tile(void *y, int64_t ldy, int out_f32, const float c[16][16], int rows, int cols) {
    const __mmask16 mask = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
    for (int i = 0; i < rows; i++) {
        const __m512 v = _mm512_load_ps(c[i]);
        if (out_f32) _mm512_mask_storeu_ps((float *)y + i * ldy, mask, v);
        else _mm256_mask_storeu_epi16((uint16_t *)y + i * ldy, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

typedef struct {  /* the activations: x [M, K] (row stride ldx), rows past the whole groups of 16 in `tail` */
    const uint16_t *x, *tail;
    int64_t M, K, ldx, whole;
} rows_t;

/* Strip s's outputs (32 features from B tiles ws: [K / 32][2][512]) for row groups [g0, g1), two groups at a
   time: C tiles 0-3 (two row groups x two feature halves), A 4-5 (the row groups), B 6-7 (the halves). `stream`:
   ws comes from memory on the first pass (read ahead), not from a buffer this thread just wrote. */
static inline void strip_rows(void *y, int64_t ldy, int out_f32, const rows_t *r, const uint16_t *ws, int64_t N,
                              int64_t s, int64_t g0, int64_t g1, int stream, float c[4][16][16]) {
    const int64_t steps = r->K / 32, elem = out_f32 ? 4 : 2;
    const int cols0 = N - s * 32 < 16 ? (int)(N - s * 32) : 16;
    const int cols1 = N - s * 32 - 16 < 16 ? (int)(N - s * 32 - 16) : 16;
    for (int64_t g = g0; g < g1; g += 2) {
        const int pair = g + 1 < g1;
        const uint16_t *a0 = g < r->whole ? r->x + g * 16 * r->ldx : r->tail;
        const uint16_t *a1 = g + 1 < r->whole ? r->x + (g + 1) * 16 * r->ldx : r->tail;
        const int64_t s0 = (g < r->whole ? r->ldx : r->K) * 2, s1 = (g + 1 < r->whole ? r->ldx : r->K) * 2;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kk = 0; kk < steps; kk++) {
            if (stream && g == g0)
                for (int l = 0; l < 2048; l += 64)
                    _mm_prefetch((const char *)(ws + kk * 1024) + PREFETCH_AHEAD + l, _MM_HINT_T0);
            _tile_loadd(4, a0 + kk * 32, s0);
            _tile_loadd(6, ws + kk * 1024, 64);
            _tile_loadd(7, ws + kk * 1024 + 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (pair) {
                _tile_loadd(5, a1 + kk * 32, s1);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        if (pair) {
            _tile_stored(2, c[2], 64);
            _tile_stored(3, c[3], 64);
        }
        for (int q = 0; q < (pair ? 4 : 2); q++) {
            const int64_t row = (g + q / 2) * 16, rows = r->M - row < 16 ? r->M - row : 16;
            const int cols = q % 2 ? cols1 : cols0;
            if (cols > 0)
                store_tile((char *)y + (row * ldy + s * 32 + q % 2 * 16) * elem, ldy, out_f32, c[q], (int)rows, cols);
        }
    }
}

/* The activations as rows_t: rows past the last whole group of 16 copied into a zeroed group (a tile reads 16
   rows). Nonzero where the copy cannot be allocated. */
static int rows_of(rows_t *r, const uint16_t *x, int64_t M, int64_t K, int64_t ldx) {
    r->x = x;
    r->tail = NULL;
    r->M = M;
    r->K = K;
    r->ldx = ldx;
    r->whole = M / 16;
    if (M % 16 == 0) return 0;
    uint16_t *tail = calloc((size_t)(16 * K), 2);
    if (tail == NULL) return 1;
    for (int64_t i = 0; i < M % 16; i++) memcpy(tail + i * K, x + (r->whole * 16 + i) * ldx, K * 2);
    r->tail = tail;
    return 0;
}

/* y [M, N] (row stride ldy; bfloat16, or float32 where out_f32) = x [M, K] bfloat16 (row stride ldx) @ W.T from
   amx_pack's wp. Threads take strips of 32 features; a strip's rows go by blocks of BLOCK_GROUPS groups of 16.
   Returns nonzero where AMX is not granted or the scratch cannot be had. */
int amx_linear(void *y, const uint16_t *x, const uint16_t *wp, int64_t M, int64_t N, int64_t K, int64_t ldx,
               int64_t ldy, int out_f32, int num_threads) {
    rows_t r;
    if (!amx_ready() || K % 32 || rows_of(&r, x, M, K, ldx)) return 1;
    const int64_t strips = (N + 31) / 32, groups = (M + 15) / 16;
    _Pragma("omp parallel num_threads(num_threads) if (num_threads > 1 && strips > 1)")
    {
        amx_configure();
        float c[4][16][16] __attribute__((aligned(64)));
        for (int64_t block = 0; block < groups; block += BLOCK_GROUPS) {
            const int64_t block_end = block + BLOCK_GROUPS < groups ? block + BLOCK_GROUPS : groups;
            _Pragma("omp for schedule(static)")
            for (int64_t s = 0; s < strips; s++)
                strip_rows(y, ldy, out_f32, &r, wp + s * (K / 32) * 1024, N, s, block, block_end, 1, c);
        }
        _tile_release();
    }
    free((void *)r.tail);
    return 0;
}

/* ---- GGUF Q4_0 / Q4_1 blocks, kept 4-bit: a third of the bytes the bfloat16 weights stream ----
   Repacked at load into the B tiles' order: per strip of 32 features and step of 32 inputs, two halves of 16
   features, each Q4_HALF_BYTES: the 16 features' fp16 scales d, their fp16 minimums m (Q4_0: zero), then 16 rows
   of 16 bytes, row p byte j holding input 2p + j % 2 of feature j / 2 (low nibble) and of feature 8 + j / 2 (high):
   the two nibble halves, widened to float32, are then the tile row's two halves in order. A thread decodes its
   strip into a buffer of bfloat16 B tiles, w = (q - 8) * d for Q4_0 and q * d + m for Q4_1 in float32 rounded to
   bfloat16 once (the values the GGUF kernel's dense bfloat16 copy holds, bit for bit), then multiplies as above. */
#define Q4_0 """ + str(Q4_0) + r"""
#define Q4_1 """ + str(Q4_1) + r"""
#define Q4_HALF_BYTES """ + str(Q4_HALF_BYTES) + r"""

static inline uint8_t q4_nibble(const uint8_t *qs, int i) { return i < 16 ? qs[i] & 0xf : qs[i - 16] >> 4; }

int amx_pack_q4(uint8_t *dst, const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes, int type, int num_threads) {
    if (K % 32 || (type != Q4_0 && type != Q4_1)) return 1;
    const int64_t strips = (N + 31) / 32, steps = K / 32, block_bytes = type == Q4_0 ? 18 : 20;
    _Pragma("omp parallel for num_threads(num_threads) if (num_threads > 1 && strips > 8)")
    for (int64_t s = 0; s < strips; s++)
        for (int64_t kk = 0; kk < steps; kk++)
            for (int h = 0; h < 2; h++) {
                uint8_t *half = dst + ((s * steps + kk) * 2 + h) * Q4_HALF_BYTES;
                memset(half, 0, Q4_HALF_BYTES);
                for (int n = 0; n < 16; n++) {
                    const int64_t feature = s * 32 + h * 16 + n;
                    if (feature >= N) continue;  /* zero scales: zero weights */
                    const uint8_t *block = w + feature * row_bytes + kk * block_bytes;
                    memcpy(half + 2 * n, block, 2);
                    if (type == Q4_1) memcpy(half + 32 + 2 * n, block + 2, 2);
                    const uint8_t *qs = block + (type == Q4_0 ? 2 : 4);
                    for (int p = 0; p < 16; p++)
                        for (int e = 0; e < 2; e++)  /* n < 8: the low nibbles; the others the high ones */
                            half[64 + p * 16 + n % 8 * 2 + e] |= (uint8_t)(q4_nibble(qs, 2 * p + e) << (n / 8 * 4));
                }
            }
    return 0;
}

/* Strip s of amx_pack_q4's form as bfloat16 B tiles [K / 32][2][512] into buf; the strip after it read ahead. */
static inline void decode_q4_strip(uint16_t *buf, const uint8_t *wq, int64_t s, int64_t strips, int64_t steps,
                                   int type) {
    const __m512i low = _mm512_set1_epi32(0xf), offset = _mm512_set1_epi32(type == Q4_0 ? 8 : 0);
    /* lane j of a row's low half: feature j / 2; of its high half: feature 8 + j / 2 */
    const __m512i first_eight = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i last_eight = _mm512_add_epi32(first_eight, _mm512_set1_epi32(8));
    const uint8_t *src = wq + s * steps * 2 * Q4_HALF_BYTES;
    const int64_t strip_bytes = steps * 2 * Q4_HALF_BYTES;
    for (int64_t t = 0; t < steps * 2; t++) {
        const uint8_t *half = src + t * Q4_HALF_BYTES;
        if (s + 1 < strips)
            for (int l = 0; l < Q4_HALF_BYTES; l += 64) _mm_prefetch((const char *)half + strip_bytes + l, _MM_HINT_T0);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)half));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(half + 32)));
        const __m512 d_lo = _mm512_permutexvar_ps(first_eight, d), d_hi = _mm512_permutexvar_ps(last_eight, d);
        const __m512 m_lo = _mm512_permutexvar_ps(first_eight, m), m_hi = _mm512_permutexvar_ps(last_eight, m);
        uint16_t *tile = buf + t * 512;
        for (int p = 0; p < 16; p++) {
            const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(half + 64 + p * 16)));
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(q, low), offset));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(q, 4), offset));
            /* words 0-15 from the low half (features 0-7), 16-31 from the high: the tile row's order */
            const __m512bh row = _mm512_cvtne2ps_pbh(_mm512_add_ps(_mm512_mul_ps(hi, d_hi), m_hi),
                                                     _mm512_add_ps(_mm512_mul_ps(lo, d_lo), m_lo));
            _mm512_store_si512(tile + p * 32, (__m512i)row);
        }
    }
}

/* amx_linear over amx_pack_q4's wq (type Q4_0 or Q4_1). */
int amx_linear_q4(void *y, const uint16_t *x, const uint8_t *wq, int64_t M, int64_t N, int64_t K, int64_t ldx,
                  int64_t ldy, int out_f32, int type, int num_threads) {
    rows_t r;
    if (!amx_ready() || K % 32 || (type != Q4_0 && type != Q4_1) || rows_of(&r, x, M, K, ldx)) return 1;
    const int64_t strips = (N + 31) / 32, groups = (M + 15) / 16, steps = K / 32;
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads) if (num_threads > 1 && strips > 1)")
    {
        amx_configure();
        float c[4][16][16] __attribute__((aligned(64)));
        uint16_t *buf = aligned_alloc(64, (size_t)(steps * 2048));
        if (buf == NULL) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        for (int64_t block = 0; block < groups; block += BLOCK_GROUPS) {
            const int64_t block_end = block + BLOCK_GROUPS < groups ? block + BLOCK_GROUPS : groups;
            _Pragma("omp for schedule(static)")
            for (int64_t s = 0; s < strips; s++) {
                if (buf == NULL) continue;
                decode_q4_strip(buf, wq, s, strips, steps, type);
                strip_rows(y, ldy, out_f32, &r, buf, N, s, block, block_end, 0, c);
            }
        }
        free(buf);
        _tile_release();
    }
    free((void *)r.tail);
    return failed;
}

int amx_supported(void) { return amx_ready(); }
"""


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """The library where the compiler builds it for this CPU and the CPU has AMX that Linux grants, else None."""
    if "amx_bf16" not in cpu_flags():
        return None
    lib = compile_or_none("amx_gemm", _SOURCE, "CPU: the AMX GEMM", "bfloat16 linears use oneDNN")
    if lib is None:
        return None
    lib.amx_pack.restype = None
    lib.amx_pack.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    lib.amx_linear.restype = ctypes.c_int
    lib.amx_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 + [ctypes.c_int] * 2
    lib.amx_pack_q4.restype = ctypes.c_int
    lib.amx_pack_q4.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    lib.amx_linear_q4.restype = ctypes.c_int
    lib.amx_linear_q4.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 + [ctypes.c_int] * 3
    lib.amx_supported.restype = ctypes.c_int
    lib.amx_supported.argtypes = []
    return lib if lib.amx_supported() else None




class AMXWeight(NamedTuple):
    """A weight [out_features, in_features] in the kernel's layout: bfloat16 tiles (amx_pack, ggml_type DENSE) or
    Q4_0 / Q4_1 blocks repacked (amx_pack_q4)."""

    packed: torch.Tensor
    out_features: int
    in_features: int
    ggml_type: int = DENSE


def amx_available() -> bool:
    """Whether this CPU multiplies bfloat16 linears here (AMX present, granted, and the kernel built)."""
    return load_kernel() is not None


def amx_applies(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[1] % 32 == 0 and amx_available())


def pack_amx(weight: torch.Tensor) -> AMXWeight:
    """The weight reordered for amx_linear; check amx_applies() first."""
    n, k = weight.shape
    weight = weight.detach().contiguous()
    packed = torch.empty((n + 31) // 32 * 32 * k, dtype=torch.int16)
    load_kernel().amx_pack(packed.data_ptr(), weight.data_ptr(), n, k, torch.get_num_threads())
    return AMXWeight(packed, n, k)


def amx_q4_applies(blocks: torch.Tensor, ggml_type: int, in_features: int) -> bool:
    return (ggml_type in Q4_TYPES and in_features % 32 == 0 and blocks.device.type == "cpu"
            and blocks.dtype == torch.uint8 and blocks.dim() == 2 and amx_available())


def pack_amx_q4(blocks: torch.Tensor, ggml_type: int, in_features: int) -> AMXWeight:
    """GGUF blocks [out_features, row_bytes] uint8 of a Q4 type repacked for amx_linear (the same 4.5 or 5 bits a
    weight); check amx_q4_applies() first."""
    n = blocks.shape[0]
    blocks = blocks.contiguous()
    packed = torch.empty((n + 31) // 32 * (in_features // 32) * 2 * Q4_HALF_BYTES, dtype=torch.uint8)
    status = load_kernel().amx_pack_q4(packed.data_ptr(), blocks.data_ptr(), n, in_features, blocks.shape[1],
                                       ggml_type, torch.get_num_threads())
    assert status == 0, "amx_q4_applies admits the type and the row length"
    return AMXWeight(packed, n, in_features, ggml_type)


def amx_linear(x: torch.Tensor, weight: AMXWeight, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [m, k] bfloat16 @ weight.T -> [m, n] in out_dtype (bfloat16 or float32)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    y = torch.empty((m, weight.out_features), dtype=out_dtype)
    arguments = (y.data_ptr(), x.data_ptr(), weight.packed.data_ptr(), m, weight.out_features, weight.in_features,
                 x.stride(0), y.stride(0), out_dtype == torch.float32)
    lib = load_kernel()
    if weight.ggml_type == DENSE:
        status = lib.amx_linear(*arguments, torch.get_num_threads())
    else:
        status = lib.amx_linear_q4(*arguments, weight.ggml_type, torch.get_num_threads())
    if status != 0:  # AMX was granted at load (amx_available), so only a scratch allocation can fail
        raise MemoryError("the AMX GEMM could not allocate its scratch")
    return y
