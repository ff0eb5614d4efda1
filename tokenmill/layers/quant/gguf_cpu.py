"""A C kernel for y = x @ dequant(W).T on the CPU, reading GGUF's quantized blocks in place.

W is a GGUF tensor as the file stores it: rows of `row_bytes` bytes, each row K / block_size blocks of one
GGML type (Q4_0, Q4_1, Q8_0: 32 weights per block; Q4_K, Q5_K, Q6_K: 256 per super-block). A decode step
reads every weight once, so memory decides its time: Q4_1 is 5 bits per weight against float32's 32.

The kernel walks the output rows in tiles of NR: it dequantizes a tile's rows into a float32 scratch buffer
that stays in L1 (the same float32 values gguf's `dequantize` gives: the product and sum in the same order,
no fused multiply-add), then takes dot products of MR activation rows with them in AVX-512 registers.
Activations stay float32, so the result differs from the dequantized model's only in summation order.
Large batches walk the activations in chunks that fit in L2, dequantizing each tile once per chunk.
Up to 8 rows (decode steps) skip the scratch buffer: each block is decoded into registers (a 4-bit block's
32 weights looked up among its 16 values, a Q5_K sub-block's among 32), with the tiles' arithmetic per
output, so a float32 row's result does not depend on the batch either (below the dense prefill path).

bfloat16 activations (gguf_gemm_bf16; Q4_0, Q4_1, Q8_0; CPUs with AVX512_BF16) multiply the weights rounded
to bfloat16 (round to nearest even, as .to(torch.bfloat16): the dense bfloat16 model's weights exactly),
products exact in float32 and sums in float32, rounded to bfloat16 once by the caller. With AMX (Linux
grants the tile state on request) a tile of 32 weight rows is decoded once per chunk of activation rows
(their pairs laid out for TDPBF16PS, in L2) and every tile has one shape, zero-padded past M and N;
without it AVX512_BF16 dot products (VDPBF16PS) take a fixed per-output chain. Either way an output's
arithmetic does not depend on how many rows are in the batch, so a row's result is the same alone or
within any batch (the prefix cache recomputes a prompt's last rows alone).

Compiled on first use (tokenmill.cpu_compile); `load_kernel()` is None where no compiler works, and the
method then dequantizes once and multiplies densely (layers.quant.gguf).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill.cpu_compile import compile_or_none
from tokenmill.layers.quant.gguf_cpu_bf16 import BF16_SOURCE

# GGML type ids (gguf.GGMLQuantizationType) the kernel reads.
Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14
KERNEL_TYPES = (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)
BF16_TYPES = (Q4_0, Q4_1, Q8_0)  # the bfloat16 path's (AVX512_BF16 CPUs: bf16_kernel_types)

_SOURCE = r"""
#define _GNU_SOURCE  /* syscall: AMX's permission */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

#define NR 4        /* weight rows per tile */
#define MR 4        /* activation rows per register tile */
#define SMALL_M 8   /* up to this many rows take the fused path */
#define L2_BYTES (512 * 1024)  /* activation rows per chunk: this many bytes of them */

static inline float half_at(const uint8_t *p) {  /* IEEE half, little-endian, to float (exact) */
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    float f;
    if (exp == 0x1f) u = sign | 0x7f800000u | (man << 13);
    else if (exp) u = sign | ((exp + 112) << 23) | (man << 13);
    else {  /* zero or subnormal: man * 2^-24 */
        f = (float)man * (1.0f / 16777216.0f);
        memcpy(&u, &f, 4);
        u |= sign;
    }
    memcpy(&f, &u, 4);
    return f;
}

/* The 6-bit scale and min of sub-block j of a K-quant super-block (12 packed bytes). */
static inline void scale_min(int j, const uint8_t *q, float *sc, float *m) {
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *m = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
        *m = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

#if defined(__AVX512F__) && defined(__F16C__)
/* The 32-weight types with AVX-512: the same products and sums as the scalar code (no FMA), 16 lanes at
   a time; the scalar loops below vectorize poorly (a decode step spent most of its time in them). */
static int dequant_row_avx512(int type, const uint8_t *src, float *dst, int64_t K) {
    const __m512i low4 = _mm512_set1_epi32(0xf);
    switch (type) {
    case Q4_0:
    case Q4_1: {
        const int bytes = type == Q4_0 ? 18 : 20;
        for (int64_t b = 0; b < K / 32; b++, src += bytes, dst += 32) {
            uint32_t halves;
            memcpy(&halves, src, 4);
            const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)halves));
            const __m512 d = _mm512_broadcastss_ps(dm);
            const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + bytes - 16)));
            __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, low4));
            __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
            if (type == Q4_0) {
                const __m512 eight = _mm512_set1_ps(8.0f);
                lo = _mm512_mul_ps(_mm512_sub_ps(lo, eight), d);
                hi = _mm512_mul_ps(_mm512_sub_ps(hi, eight), d);
            } else {
                const __m512 m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
                lo = _mm512_add_ps(_mm512_mul_ps(lo, d), m);
                hi = _mm512_add_ps(_mm512_mul_ps(hi, d), m);
            }
            _mm512_storeu_ps(dst, lo);
            _mm512_storeu_ps(dst + 16, hi);
        }
        return 1;
    }
    case Q8_0:
        for (int64_t b = 0; b < K / 32; b++, src += 34, dst += 32) {
            uint16_t half;
            memcpy(&half, src, 2);
            const __m512 d = _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(half)));
            const __m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 2)));
            const __m512i q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 18)));
            _mm512_storeu_ps(dst, _mm512_mul_ps(_mm512_cvtepi32_ps(q0), d));
            _mm512_storeu_ps(dst + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(q1), d));
        }
        return 1;
    }
    return 0;
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
/* Few rows (m <= SMALL_M): a block of each of fused_rows(m) weight rows is decoded into registers, to the
   float32 values dequant_row gives, and used by every activation row; no scratch buffer (AVX512BW too: the
   K-quants' byte operations; every AVX-512 CPU but the Xeon Phi has it). Every output is
   reduce_add(acc) with acc = fma(x, w, acc) over chunks of 16 weights in order: the tile path's arithmetic
   exactly, so a row's result does not depend on how many rows come with it (below DENSE_GEMM_ROWS).
   A 4-bit block has 16 values: they are computed once (the same products and sums as dequant_row's) and
   its 32 weights looked up by their nibbles (VPERMPS reads an index's low 4 bits only). With the scales
   gathered 16 blocks at a time, a Q4_1 block at one row takes 7 vector instructions (5 to decode, 2 FMAs),
   3 of them on the shuffle port, where converting every weight and each scale alone took 13, 8 on that
   port: the decode, not memory, bound this path (BENCHMARKS.md, issue 23). */
/* Bytes ahead the weights are prefetched: a decode step's weights come from memory, not the caches (one row
   over 110 MB of Q4_1 weights: 1.5x faster with it, the same from 2 to 16 KiB ahead). A step of nr weight
   rows reads one contiguous span, nr * bytes a block. */
#define PREFETCH_BYTES 4096
#define K_PREFETCH_BYTES 512  /* the K-quants': each weight row's own, this far ahead (5-10% over 1 KiB) */
#define FR_MAX 4  /* weight rows per step, fused_rows(m): m * that many accumulators (8 at m = 1: no faster) */
static inline int fused_rows(int m) { return m <= 4 ? 4 : 2; }

/* The scales (d, and Q4_1's m) of up to 16 blocks of a row as float32, in one gather: converting them one
   by one took as many shuffle-port instructions as the rest of a block's decode. */
static inline __attribute__((always_inline)) void fused_scales(const int type, const uint8_t *src, int kb,
                                                               float *d, float *m) {
    const int bytes = type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34;
    const __m512i at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(bytes));
    const __m512i halves = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), (__mmask16)((1u << kb) - 1), at,
                                                       src, 1);  /* each block's first 4 bytes */
    _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(halves)));
    if (type == Q4_1) _mm512_storeu_ps(m, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(halves, 16))));
}

/* Block `src`'s 32 weights as dequant_row gives them, d and m its scales. */
static inline __attribute__((always_inline)) void fused_block(const int type, const uint8_t *src, float d,
                                                              float m, __m512 *lo, __m512 *hi) {
    const __m512 dv = _mm512_set1_ps(d);
    if (type == Q8_0) {
        *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 2)))), dv);
        *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 18)))), dv);
        return;
    }
    const int bytes = type == Q4_0 ? 18 : 20;
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    /* q * d is exact in float32 (4 bits times 11), so one rounding, fused or not: dequant_row's values. */
    const __m512 values = type == Q4_0 ? _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(8.0f)), dv)
                                       : _mm512_fmadd_ps(iota, dv, _mm512_set1_ps(m));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + bytes - 16)));
    *lo = _mm512_permutexvar_ps(q, values);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), values);
}

/* acc[i][j] += x[i] . (lo[j], hi[j]) over 32 weights, for mr activation rows (stride K) and nr weight rows:
   two FMAs per output, its 16-weight chunks in order. */
static inline __attribute__((always_inline)) void fused_fma(const float *xb, int64_t K, const int mr,
                                                            const int nr, const __m512 *lo, const __m512 *hi,
                                                            __m512 acc[SMALL_M][FR_MAX]) {
    for (int i = 0; i < mr; i++) {
        const __m512 x0 = _mm512_loadu_ps(xb + i * K), x1 = _mm512_loadu_ps(xb + i * K + 16);
        for (int j = 0; j < nr; j++) {
            acc[i][j] = _mm512_fmadd_ps(x0, lo[j], acc[i][j]);
            acc[i][j] = _mm512_fmadd_ps(x1, hi[j], acc[i][j]);
        }
    }
}

/* The 32-weight types (Q4_0, Q4_1, Q8_0). */
static inline __attribute__((always_inline)) void fused_blocks(const int type, const uint8_t *w,
                                                               int64_t row_bytes, const float *x, int64_t K,
                                                               __m512 acc[SMALL_M][FR_MAX], const int mr,
                                                               const int nr) {
    const int bytes = type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34;
    const int64_t nb = K / 32;
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int kb = nb - b0 < 16 ? (int)(nb - b0) : 16;
        float d[FR_MAX][16], m[FR_MAX][16];
        for (int j = 0; j < nr; j++) fused_scales(type, w + j * row_bytes + b0 * bytes, kb, d[j], m[j]);
        for (int b = 0; b < kb; b++) {
            __m512 lo[FR_MAX], hi[FR_MAX];
            for (int j = 0; j < nr; j++)
                fused_block(type, w + j * row_bytes + (b0 + b) * bytes, d[j][b], m[j][b], &lo[j], &hi[j]);
            /* An address past the weights' end is only a hint: prefetches never fault. */
            const char *ahead = (const char *)((uintptr_t)w + PREFETCH_BYTES + (b0 + b) * nr * bytes);
            for (int l = 0; l < nr * bytes; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
            fused_fma(x + (b0 + b) * 32, K, mr, nr, lo, hi, acc);
        }
    }
}

/* The K-quants: a super-block of 256 weights is 8 units of 32, decoded as dequant_row gives them (its scales
   first, for every unit: k_scales, q6_k_scales), each unit into two vectors as a 32-weight block is. A
   4-bit unit (Q4_K) is one 16-value table looked up by nibble. Q5_K's 5-bit and Q6_K's 6-bit quants are
   first assembled as bytes, 64 at a time, into a 256-byte buffer in L1 (q5_k_quants, q6_k_quants): 3 to 5
   instructions per 64 weights, where assembling them in 32-bit lanes took 2 or 3 per 16. A Q5_K unit then
   looks its weights up among 32 values (VPERMT2PS reads an index's low 5 bits); Q6_K's 64 values are too
   many for tables, so its quants are converted and scaled. */
static inline __attribute__((always_inline)) __m512i nibbles(const uint8_t *q, const int high) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    return high ? _mm512_srli_epi32(v, 4) : v;  /* the low nibble's upper bits: ignored by VPERMPS */
}

/* Bits 0-3 of each byte from low, bits 4-7 from high (VPTERNLOGD's bitwise select). */
static inline __attribute__((always_inline)) __m512i low4_high(__m512i low, __m512i high) {
    return _mm512_ternarylogic_epi32(_mm512_set1_epi8(0xf), low, high, 0xca);
}

/* 32 bytes at p, in both halves of a vector: a load, no shuffle. */
static inline __attribute__((always_inline)) __m512i both_halves(const uint8_t *p) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
}

/* 16-bit lanes' shift counts: a in the low half (32 bytes), b in the high. */
static inline __attribute__((always_inline)) __m512i halves_by(const int a, const int b) {
    return _mm512_mask_blend_epi16(0xffff0000u, _mm512_set1_epi16((short)a), _mm512_set1_epi16((short)b));
}

/* Q4_K / Q5_K: the 8 sub-blocks' d * scale (sc[0..7]) and dmin * min (sc[8..15]) as dequant_row computes
   them (products of a float16 and 6 bits: exact), unpacked from their 12 bytes 16 lanes at once. */
static inline __attribute__((always_inline)) void k_scales(const uint8_t *src, float *sc) {
    /* Lane j < 8: scale j; lane 8 + j: min j. Low bits from byte at[], shifted by by[] and masked by
       keep[]; sub-blocks 4-7 take their top 2 bits from byte top[] (bits 6-7, to bits 4-5). */
    const __m512i at = _mm512_set_epi32(11, 10, 9, 8, 7, 6, 5, 4, 11, 10, 9, 8, 3, 2, 1, 0);
    const __m512i by = _mm512_set_epi32(4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i keep = _mm512_set_epi32(15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63);
    const __m512i top = _mm512_set_epi32(7, 6, 5, 4, 0, 0, 0, 0, 3, 2, 1, 0, 0, 0, 0, 0);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + 4)));
    const __m512i low = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(at, bytes), by), keep);
    const __m512i high = _mm512_slli_epi32(_mm512_srli_epi32(_mm512_permutexvar_epi32(top, bytes), 6), 4);
    const __m512i six = _mm512_mask_or_epi32(low, 0xf0f0, low, high);
    uint32_t halves;
    memcpy(&halves, src, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)halves));  /* d, dmin */
    const __m512 d = _mm512_mask_blend_ps(0xff00, _mm512_broadcastss_ps(dm),
                                          _mm512_broadcastss_ps(_mm_movehdup_ps(dm)));
    _mm512_storeu_ps(sc, _mm512_mul_ps(_mm512_cvtepi32_ps(six), d));
}

/* Q4_K unit u: sub-block u, the low (u even) or high nibbles of 32 bytes. Its 16 values d1 * q - dm1
   (d1 * q exact: 4 bits times 17) as one table. */
static inline __attribute__((always_inline)) void q4_k_unit(const uint8_t *src, const float *sc, const int u,
                                                            __m512 *lo, __m512 *hi) {
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 values = _mm512_fmsub_ps(iota, _mm512_set1_ps(sc[u]), _mm512_set1_ps(sc[8 + u]));
    const uint8_t *q = src + 16 + 32 * (u / 2);
    *lo = _mm512_permutexvar_ps(nibbles(q, u & 1), values);
    *hi = _mm512_permutexvar_ps(nibbles(q + 16, u & 1), values);
}

/* Q5_K: q[32 u + l] = sub-block u's quant l (bits 0-4; bits 5-7 left over). A pair of sub-blocks is the
   low and high nibbles of 32 bytes, with bits 2c and 2c + 1 of qh[l]; shifting 16-bit lanes moves a
   neighbour byte's bits only into bits that are replaced or ignored. */
static inline __attribute__((always_inline)) void q5_k_quants(const uint8_t *src, uint8_t *q) {
    const __m512i qh = both_halves(src + 16);
    _Pragma("GCC unroll 4")
    for (int c = 0; c < 4; c++) {
        const __m512i ql = _mm512_srlv_epi16(both_halves(src + 48 + 32 * c), halves_by(0, 4));
        const __m512i high = c < 2 ? _mm512_sllv_epi16(qh, halves_by(4 - 2 * c, 3 - 2 * c))
                                   : _mm512_srlv_epi16(qh, halves_by(2 * c - 4, 2 * c - 3));
        _mm512_storeu_si512(q + 64 * c, low4_high(ql, high));
    }
}

/* Q5_K unit u: 32 values d1 * q - dm1 (exact products: 5 bits times 17) in two tables. */
static inline __attribute__((always_inline)) void q5_k_unit(const uint8_t *q, const float *sc, const int u,
                                                            __m512 *lo, __m512 *hi) {
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 d1 = _mm512_set1_ps(sc[u]), dm1 = _mm512_set1_ps(sc[8 + u]);
    const __m512 values = _mm512_fmsub_ps(iota, d1, dm1);
    const __m512 values16 = _mm512_fmsub_ps(_mm512_add_ps(iota, _mm512_set1_ps(16.0f)), d1, dm1);
    *lo = _mm512_permutex2var_ps(values, nibbles(q + 32 * u, 0), values16);
    *hi = _mm512_permutex2var_ps(values, nibbles(q + 32 * u + 16, 0), values16);
}

/* Q6_K: the 16 sub-blocks' d * scale (exact: 11 bits times 8). */
static inline __attribute__((always_inline)) void q6_k_scales(const uint8_t *src, float *sc) {
    uint16_t half;
    memcpy(&half, src + 208, 2);
    const __m512 d = _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(half)));
    const __m512i scales = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 192)));
    _mm512_storeu_ps(sc, _mm512_mul_ps(_mm512_cvtepi32_ps(scales), d));
}

/* Q6_K: q[i] = quant i - 32 as int8, in weight order. Each half of the super-block: groups 0 and 1 are the
   low nibbles of its 64 bytes of ql with bits 0-1 and 2-3 of qh[l]; groups 2 and 3 the high nibbles with
   bits 4-5 and 6-7 (dequant_row's q1..q4). */
static inline __attribute__((always_inline)) void q6_k_quants(const uint8_t *src, int8_t *q) {
    const __m512i six = _mm512_set1_epi8(63), bias = _mm512_set1_epi8(32);
    _Pragma("GCC unroll 2")
    for (int h = 0; h < 2; h++) {
        const __m512i ql = _mm512_loadu_si512(src + 64 * h), qh = both_halves(src + 128 + 32 * h);
        const __m512i g01 = low4_high(ql, _mm512_sllv_epi16(qh, halves_by(4, 2)));
        const __m512i g23 = low4_high(_mm512_srli_epi16(ql, 4), _mm512_srlv_epi16(qh, halves_by(0, 2)));
        _mm512_storeu_si512(q + 128 * h, _mm512_sub_epi8(_mm512_and_si512(g01, six), bias));
        _mm512_storeu_si512(q + 128 * h + 64, _mm512_sub_epi8(_mm512_and_si512(g23, six), bias));
    }
}

/* Q6_K unit u: sub-blocks 2u and 2u + 1, (d * scale) * q as dequant_row multiplies. */
static inline __attribute__((always_inline)) void q6_k_unit(const int8_t *q, const float *sc, const int u,
                                                            __m512 *lo, __m512 *hi) {
    const __m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * u)));
    const __m512i q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * u + 16)));
    *lo = _mm512_mul_ps(_mm512_set1_ps(sc[2 * u]), _mm512_cvtepi32_ps(q0));
    *hi = _mm512_mul_ps(_mm512_set1_ps(sc[2 * u + 1]), _mm512_cvtepi32_ps(q1));
}

static inline __attribute__((always_inline)) void fused_super_blocks(const int type, const uint8_t *w,
                                                                     int64_t row_bytes, const float *x,
                                                                     int64_t K, __m512 acc[SMALL_M][FR_MAX],
                                                                     const int mr, const int nr) {
    const int bytes = type == Q4_K ? 144 : type == Q5_K ? 176 : 210;
    for (int64_t b = 0; b < K / 256; b++) {
        float sc[FR_MAX][16];
        _Alignas(64) uint8_t q[FR_MAX][256];
        for (int j = 0; j < nr; j++) {
            const uint8_t *src = w + j * row_bytes + b * bytes;
            if (type == Q6_K) {
                q6_k_scales(src, sc[j]);
                q6_k_quants(src, (int8_t *)q[j]);
            } else {
                k_scales(src, sc[j]);
                if (type == Q5_K) q5_k_quants(src, q[j]);
            }
            /* Each row's next weights (rows of K-quants are long: one span ahead would lag its last rows). */
            for (int l = 0; l < bytes; l += 64) _mm_prefetch((const char *)src + K_PREFETCH_BYTES + l, _MM_HINT_T0);
        }
        /* The units read the scales and quants from memory (broadcasts and widening loads: load ports):
           without this, the compiler takes them from the stored vectors by shuffles, on the port the
           lookups need. */
        __asm__("" : "+m"(sc), "+m"(q));
        _Pragma("GCC unroll 8")
        for (int u = 0; u < 8; u++) {
            __m512 lo[FR_MAX], hi[FR_MAX];
            for (int j = 0; j < nr; j++) {
                if (type == Q4_K) q4_k_unit(w + j * row_bytes + b * bytes, sc[j], u, &lo[j], &hi[j]);
                else if (type == Q5_K) q5_k_unit(q[j], sc[j], u, &lo[j], &hi[j]);
                else q6_k_unit((const int8_t *)q[j], sc[j], u, &lo[j], &hi[j]);
            }
            fused_fma(x + b * 256 + u * 32, K, mr, nr, lo, hi, acc);
        }
    }
}

static inline __attribute__((always_inline)) void fused(const int type, const uint8_t *w, int64_t row_bytes,
                                                        const float *x, int64_t K, float *y, int64_t ldy,
                                                        const int mr, const int nr) {
    __m512 acc[SMALL_M][FR_MAX];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    if (type == Q4_K || type == Q5_K || type == Q6_K) fused_super_blocks(type, w, row_bytes, x, K, acc, mr, nr);
    else fused_blocks(type, w, row_bytes, x, K, acc, mr, nr);
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]);
}

/* The instances: the type, m and a whole step of weight rows (or one, for the last rows) as constants. */
#define FUSED_M(T, M) \
    case M: \
        if (nr == fused_rows(M)) fused(T, w, row_bytes, x, K, y, ldy, M, fused_rows(M)); \
        else for (int j = 0; j < nr; j++) fused(T, w + j * row_bytes, row_bytes, x, K, y + j, ldy, M, 1); \
        return;
#define FUSED_TYPE(T) \
    static void fused_##T(const uint8_t *w, int64_t row_bytes, const float *x, int64_t M, int64_t K, float *y, \
                          int64_t ldy, int nr) { \
        switch (M) { FUSED_M(T, 1) FUSED_M(T, 2) FUSED_M(T, 3) FUSED_M(T, 4) FUSED_M(T, 5) FUSED_M(T, 6) \
                     FUSED_M(T, 7) FUSED_M(T, 8) } \
    }
FUSED_TYPE(Q4_0)
FUSED_TYPE(Q4_1)
FUSED_TYPE(Q8_0)
FUSED_TYPE(Q4_K)
FUSED_TYPE(Q5_K)
FUSED_TYPE(Q6_K)

static void small_m(int type, const uint8_t *w, const float *x, int64_t M, int64_t N, int64_t K,
                    int64_t row_bytes, float *y, int64_t ldy, int num_threads) {
    const int fr = fused_rows((int)M);
    const int64_t steps = (N + fr - 1) / fr;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && N >= 64)")
    for (int64_t s = 0; s < steps; s++) {
        const int64_t n0 = s * fr;
        const int nr = N - n0 < fr ? (int)(N - n0) : fr;
        const uint8_t *ws = w + n0 * row_bytes;
        switch (type) {
        case Q4_0: fused_Q4_0(ws, row_bytes, x, M, K, y + n0, ldy, nr); break;
        case Q4_1: fused_Q4_1(ws, row_bytes, x, M, K, y + n0, ldy, nr); break;
        case Q8_0: fused_Q8_0(ws, row_bytes, x, M, K, y + n0, ldy, nr); break;
        case Q4_K: fused_Q4_K(ws, row_bytes, x, M, K, y + n0, ldy, nr); break;
        case Q5_K: fused_Q5_K(ws, row_bytes, x, M, K, y + n0, ldy, nr); break;
        default: fused_Q6_K(ws, row_bytes, x, M, K, y + n0, ldy, nr);
        }
    }
}
#endif

/* One row of K weights (whole blocks) as float32. */
static void dequant_row(int type, const uint8_t *src, float *dst, int64_t K) {
#if defined(__AVX512F__) && defined(__F16C__)
    if (dequant_row_avx512(type, src, dst, K)) return;
#endif
    switch (type) {
    case Q4_0:
        for (int64_t b = 0; b < K / 32; b++, src += 18, dst += 32) {
            const float d = half_at(src);
            const uint8_t *q = src + 2;
            for (int j = 0; j < 16; j++) {
                dst[j] = (float)((int)(q[j] & 0xf) - 8) * d;
                dst[j + 16] = (float)((int)(q[j] >> 4) - 8) * d;
            }
        }
        break;
    case Q4_1:
        for (int64_t b = 0; b < K / 32; b++, src += 20, dst += 32) {
            const float d = half_at(src), m = half_at(src + 2);
            const uint8_t *q = src + 4;
            for (int j = 0; j < 16; j++) {
                dst[j] = (float)(q[j] & 0xf) * d + m;
                dst[j + 16] = (float)(q[j] >> 4) * d + m;
            }
        }
        break;
    case Q8_0:
        for (int64_t b = 0; b < K / 32; b++, src += 34, dst += 32) {
            const float d = half_at(src);
            const int8_t *q = (const int8_t *)(src + 2);
            for (int j = 0; j < 32; j++) dst[j] = (float)q[j] * d;
        }
        break;
    case Q4_K:
    case Q5_K: {
        const int five = type == Q5_K, bytes = five ? 176 : 144;
        for (int64_t b = 0; b < K / 256; b++, src += bytes) {
            const float d = half_at(src), dmin = half_at(src + 2);
            const uint8_t *scales = src + 4, *qh = src + 16, *ql = src + (five ? 48 : 16);
            for (int c = 0; c < 4; c++, ql += 32, dst += 64) {  /* 64 weights: two sub-blocks */
                float s1, m1, s2, m2;
                scale_min(2 * c, scales, &s1, &m1);
                scale_min(2 * c + 1, scales, &s2, &m2);
                const float d1 = d * s1, dm1 = dmin * m1, d2 = d * s2, dm2 = dmin * m2;
                for (int l = 0; l < 32; l++) {
                    int lo = ql[l] & 0xf, hi = ql[l] >> 4;
                    if (five) {
                        lo += (qh[l] >> (2 * c) & 1) << 4;
                        hi += (qh[l] >> (2 * c + 1) & 1) << 4;
                    }
                    dst[l] = d1 * (float)lo - dm1;
                    dst[l + 32] = d2 * (float)hi - dm2;
                }
            }
        }
        break;
    }
    case Q6_K:
        for (int64_t b = 0; b < K / 256; b++, src += 210) {
            const uint8_t *ql = src, *qh = src + 128;
            const int8_t *sc = (const int8_t *)(src + 192);
            const float d = half_at(src + 208);
            for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8, dst += 128) {
                for (int l = 0; l < 32; l++) {
                    const int s = l / 16;
                    const int q1 = ((ql[l] & 0xf) | ((qh[l] & 3) << 4)) - 32;
                    const int q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    dst[l] = d * (float)sc[s] * (float)q1;
                    dst[l + 32] = d * (float)sc[s + 2] * (float)q2;
                    dst[l + 64] = d * (float)sc[s + 4] * (float)q3;
                    dst[l + 96] = d * (float)sc[s + 6] * (float)q4;
                }
            }
        }
        break;
    }
}

/* y[i][j] = x[i] . w[j] for i < mr, j < nr (K a multiple of 16), mr and nr constants once inlined. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t K, const float *w, float *y,
                                                       int64_t ldy, const int mr, const int nr) {
#ifdef __AVX512F__
    __m512 acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m512 wv[NR];
        for (int j = 0; j < nr; j++) wv[j] = _mm512_loadu_ps(w + j * K + k);
        for (int i = 0; i < mr; i++) {
            const __m512 xv = _mm512_loadu_ps(x + i * K + k);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]);
#else
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float s = 0.0f;
            _Pragma("omp simd reduction(+:s)")
            for (int64_t k = 0; k < K; k++) s += x[i * K + k] * w[j * K + k];
            y[i * ldy + j] = s;
        }
#endif
}

static void tile_any(const float *x, int64_t K, const float *w, float *y, int64_t ldy, int mr, int nr) {
    if (nr == NR) {
        switch (mr) {
        case 4: tile(x, K, w, y, ldy, 4, NR); return;
        case 3: tile(x, K, w, y, ldy, 3, NR); return;
        case 2: tile(x, K, w, y, ldy, 2, NR); return;
        default: tile(x, K, w, y, ldy, 1, NR); return;
        }
    }
    for (int j = 0; j < nr; j++)
        for (int i = 0; i < mr; i++) tile(x + i * K, K, w + j * K, y + i * ldy + j, ldy, 1, 1);
}

/* y [M, N] (row stride ldy) = x [M, K] @ dequant(w [N rows of row_bytes]).T. Returns nonzero, touching
   nothing, where K is not whole blocks of 32 or the scratch cannot be allocated. */
int gguf_gemm(float *y, const float *x, const uint8_t *w, int64_t M, int64_t N, int64_t K, int64_t row_bytes,
              int type, int64_t ldy, int num_threads) {
    if (K % 32) return 1;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
    if (M <= SMALL_M) {
        small_m(type, w, x, M, N, K, row_bytes, y, ldy, num_threads);
        return 0;
    }
#endif
    const int64_t tiles = (N + NR - 1) / NR;
    int64_t chunk = L2_BYTES / (K * 4);
    chunk = chunk < MR ? MR : chunk / MR * MR;
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads) if (num_threads > 1 && tiles > 1)")
    {
        float *wt = aligned_alloc(64, (size_t)(NR * K * 4));
        if (wt == NULL) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
            const int64_t m1 = m0 + chunk < M ? m0 + chunk : M;
            _Pragma("omp for schedule(static)")
            for (int64_t t = 0; t < tiles; t++) {
                if (wt == NULL) continue;
                const int64_t n0 = t * NR;
                const int nr = N - n0 < NR ? (int)(N - n0) : NR;
                for (int j = 0; j < nr; j++) dequant_row(type, w + (n0 + j) * row_bytes, wt + j * K, K);
                for (int64_t i = m0; i < m1; i += MR) {
                    const int mr = m1 - i < MR ? (int)(m1 - i) : MR;
                    tile_any(x + i * K, K, wt, y + i * ldy + n0, ldy, mr, nr);
                }
            }
        }
        free(wt);
    }
    return failed;
}

""" + BF16_SOURCE + r"""
/* The float32 values of N rows: the prefill path's dense tile, and the tests' view of the decoding. */
void gguf_dequantize(float *dst, const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes, int type,
                     int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) if (num_threads > 1 && N > 64)")
    for (int64_t n = 0; n < N; n++) dequant_row(type, w + n * row_bytes, dst + n * K, K);
}
"""


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    lib = compile_or_none("gguf_gemm", _SOURCE, "GGUF on the CPU: the C kernel",
                          "weights are dequantized once and multiplied densely")
    if lib is None:
        return None
    lib.gguf_gemm.restype = ctypes.c_int
    lib.gguf_gemm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_int, ctypes.c_int64,
                                                                             ctypes.c_int]
    lib.gguf_gemm_bf16.restype = ctypes.c_int
    lib.gguf_gemm_bf16.argtypes = lib.gguf_gemm.argtypes
    lib.gguf_bf16_supported.restype = ctypes.c_int
    lib.gguf_bf16_supported.argtypes = []
    lib.gguf_dequantize_bf16.restype = ctypes.c_int
    lib.gguf_dequantize_bf16.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_int]
    lib.gguf_dequantize.restype = None
    lib.gguf_dequantize.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_int]
    return lib


def gguf_gemm_cpu(x: torch.Tensor, weight: torch.Tensor, ggml_type: int, k: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] float32 contiguous @ dequant(weight [n, row_bytes] uint8).T -> [m, n] float32 (or into
    `out`, a [m, n] float32 view with unit column stride: a fused layer's slice)."""
    m, n = x.shape[0], weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    status = load_kernel().gguf_gemm(out.data_ptr(), x.data_ptr(), weight.data_ptr(), m, n, k, weight.shape[1],
                                     ggml_type, out.stride(0), torch.get_num_threads())
    assert status == 0, "K is whole blocks (the loader checks it) and the scratch is a few KiB"
    return out


@functools.cache
def bf16_kernel_types() -> tuple[int, ...]:
    """The GGML types gguf_gemm_bf16_cpu serves here: none without AVX512_BF16 (or without the kernel)."""
    lib = load_kernel()
    return BF16_TYPES if lib is not None and lib.gguf_bf16_supported() else ()


def gguf_gemm_bf16_cpu(x: torch.Tensor, weight: torch.Tensor, ggml_type: int, k: int,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] bfloat16 contiguous @ bf16(dequant(weight)).T -> [m, n] float32 (or into `out`, as
    gguf_gemm_cpu), for ggml_type in bf16_kernel_types()."""
    m, n = x.shape[0], weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    status = load_kernel().gguf_gemm_bf16(out.data_ptr(), x.data_ptr(), weight.data_ptr(), m, n, k,
                                          weight.shape[1], ggml_type, out.stride(0), torch.get_num_threads())
    assert status == 0, "the type is served (bf16_kernel_types), K is whole blocks, the scratch a few KiB"
    return out


def gguf_dequantize_cpu(weight: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """dequant(weight [n, row_bytes] uint8) -> [n, k] float32."""
    out = torch.empty(weight.shape[0], k, dtype=torch.float32)
    load_kernel().gguf_dequantize(out.data_ptr(), weight.data_ptr(), weight.shape[0], k, weight.shape[1],
                                  ggml_type, torch.get_num_threads())
    return out


def gguf_dequantize_bf16_cpu(weight: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """dequant(weight [n, row_bytes] uint8) -> [n, k] bfloat16 (round to nearest even), for ggml_type in
    bf16_kernel_types()."""
    out = torch.empty(weight.shape[0], k, dtype=torch.bfloat16)
    status = load_kernel().gguf_dequantize_bf16(out.data_ptr(), weight.data_ptr(), weight.shape[0], k,
                                                weight.shape[1], ggml_type, torch.get_num_threads())
    assert status == 0, "the type is served (bf16_kernel_types) and K is whole blocks"
    return out
