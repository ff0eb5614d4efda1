"""The bfloat16 part of the GGUF CPU kernel's C source (layers.quant.gguf_cpu compiles both as one library):
AVX512_BF16 dot products, and AMX tiles where Linux grants them, for Q4_0, Q4_1 and Q8_0 blocks."""

from tokenmill.cpu_compile import AMX_C

BF16_SOURCE = r"""
/* ---- bfloat16 activations (Q4_0, Q4_1, Q8_0), AVX512_BF16 ----------------------------------------------
   Every output is y[i][j] = reduce_add(acc), acc = 0, then for each chunk of 32 weights in order
   acc = dpbf16(acc, x_i[chunk], w_j[chunk]), with w_j the bfloat16 rounding (round to nearest even) of the
   float32 values dequant_row gives: the dense bfloat16 model's weights exactly. That sequence is the same
   whatever the number of rows and whichever path (fused or tiled) takes them, so a row's result does not
   depend on the batch it is computed in. */
#if defined(__AVX512F__) && defined(__F16C__) && defined(__AVX512BF16__)
#define BNR 8   /* weight rows per tile */
#define BMR 3   /* activation rows per register tile: BMR * BNR accumulators */
#define BF16_FUSED_M 2  /* up to this many rows decode each block straight into registers */

/* 32 weights of block b of a row, as bfloat16 in order. */
static inline __attribute__((always_inline)) __m512i block_bf16(int type, const uint8_t *row, int64_t b) {
    __m512 lo, hi;
    if (type == Q8_0) {
        const uint8_t *src = row + b * 34;
        uint16_t half;
        memcpy(&half, src, 2);
        const __m512 d = _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(half)));
        lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 2)))), d);
        hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 18)))), d);
    } else {
        /* A 4-bit block has 16 values: compute them (as dequant_row does: (q - 8) * d, q * d + m), round
           them to bfloat16 once, and look the 32 weights up by their nibbles. */
        const int bytes = type == Q4_0 ? 18 : 20;
        const uint8_t *src = row + b * bytes;
        uint32_t halves;
        memcpy(&halves, src, 4);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)halves));
        const __m512 d = _mm512_broadcastss_ps(dm);
        const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        __m512 values;
        if (type == Q4_0) values = _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(8.0f)), d);
        else values = _mm512_add_ps(_mm512_mul_ps(iota, d), _mm512_broadcastss_ps(_mm_movehdup_ps(dm)));
        const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(values));
        const __m128i q = _mm_loadu_si128((const __m128i *)(src + bytes - 16)), nib = _mm_set1_epi8(0xf);
        const __m256i both = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), nib), _mm_and_si128(q, nib));
        return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(both), table);
    }
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

#define DP(acc, a, b) _mm512_dpbf16_ps((acc), (__m512bh)(a), (__m512bh)(b))

/* Few rows: nr weight rows at a time, each block decoded into a register and used by every row. */
static inline __attribute__((always_inline)) void bf16_fused(int type, const uint8_t *w, int64_t row_bytes,
                                                             const uint16_t *x, int64_t K, float *y,
                                                             int64_t ldy, const int mr, const int nr) {
    __m512 acc[BF16_FUSED_M][BNR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / 32; b++) {
        __m512i xv[BF16_FUSED_M];
        for (int i = 0; i < mr; i++) xv[i] = _mm512_loadu_si512(x + i * K + b * 32);
        for (int j = 0; j < nr; j++) {
            const __m512i wv = block_bf16(type, w + j * row_bytes, b);
            for (int i = 0; i < mr; i++) acc[i][j] = DP(acc[i][j], xv[i], wv);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]);
}

/* y[i][j] = x[i] . wt[j] for i < mr, j < nr, wt a decoded tile of bfloat16 rows. */
static inline __attribute__((always_inline)) void bf16_tile(const uint16_t *x, int64_t K, const uint16_t *wt,
                                                            float *y, int64_t ldy, const int mr, const int nr) {
    __m512 acc[BMR][BNR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512i xv[BMR];
        for (int i = 0; i < mr; i++) xv[i] = _mm512_loadu_si512(x + i * K + k);
        for (int j = 0; j < nr; j++) {
            const __m512i wv = _mm512_load_si512(wt + j * K + k);
            for (int i = 0; i < mr; i++) acc[i][j] = DP(acc[i][j], xv[i], wv);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]);
}

static void bf16_tile_any(const uint16_t *x, int64_t K, const uint16_t *wt, float *y, int64_t ldy, int mr,
                          int nr) {
    if (nr == BNR) {
        switch (mr) {
        case 3: bf16_tile(x, K, wt, y, ldy, 3, BNR); return;
        case 2: bf16_tile(x, K, wt, y, ldy, 2, BNR); return;
        default: bf16_tile(x, K, wt, y, ldy, 1, BNR); return;
        }
    }
    for (int j = 0; j < nr; j++)
        for (int i = 0; i < mr; i++) bf16_tile(x + i * K, K, wt + j * K, y + i * ldy + j, ldy, 1, 1);
}

static void bf16_fused_any(int type, const uint8_t *w, int64_t row_bytes, const uint16_t *x, int64_t K,
                           float *y, int64_t ldy, int mr, int nr) {
    if (nr == BNR) {
        if (mr == 2) bf16_fused(type, w, row_bytes, x, K, y, ldy, 2, BNR);
        else bf16_fused(type, w, row_bytes, x, K, y, ldy, 1, BNR);
        return;
    }
    for (int j = 0; j < nr; j++)
        for (int i = 0; i < mr; i++)
            bf16_fused(type, w + j * row_bytes, row_bytes, x + i * K, K, y + i * ldy + j, ldy, 1, 1);
}
#endif

#if defined(__AVX512F__) && defined(__F16C__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && \
    defined(__AMX_BF16__) && defined(__linux__)
#define HAVE_AMX 1
/* AMX: C [16 weight rows, 16 activation rows] += A [16 weight rows, 32 k] . B [16 k pairs, 16 activation
   rows, 2]. The weights are decoded 16 rows at a time into a bfloat16 tile (rows past N zero), the
   activations laid out once in pairs (columns past M zero), and every tile has the one shape, whatever M:
   an output's products and sums do not depend on its neighbours, so a row's result does not depend on
   how many rows come with it. */
""" + AMX_C + r"""
#define AMX_X_BYTES (512 * 1024)  /* activation rows per chunk: this many bytes of their pairs (in L2); each
                                     weight tile is decoded once per chunk */

/* Tiles: C 0-3 (two weight halves x two activation groups), A 4-5 (the weight halves), B 6-7 (the groups):
   four independent accumulations per step, so the dot products' latency overlaps. */
static inline void amx_step(const uint16_t *wt, int64_t K, const uint32_t *xv, int64_t cap, int64_t g,
                            int one_group) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    if (one_group) {  /* the last group alone (its pair all padding): the same products for C 0-1 */
        for (int64_t k = 0; k < K; k += 32) {
            _tile_loadd(4, wt + k, K * 2);
            _tile_loadd(5, wt + 16 * K + k, K * 2);
            _tile_loadd(6, xv + k / 2 * cap + g * 16, cap * 4);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
        }
        return;
    }
    for (int64_t k = 0; k < K; k += 32) {
        _tile_loadd(4, wt + k, K * 2);
        _tile_loadd(5, wt + 16 * K + k, K * 2);
        _tile_loadd(6, xv + k / 2 * cap + g * 16, cap * 4);
        _tile_loadd(7, xv + k / 2 * cap + g * 16 + 16, cap * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
    }
}

/* out[i][j] = c[j][i] for a 16 x 16 float tile: 32-bit, then 64-bit interleaves within 128-bit lanes,
   then a 4 x 4 transpose of the lanes. */
static inline void transpose16(const float c[16][16], __m512 *out) {
    __m512i a[16], b[16];
    for (int j = 0; j < 16; j += 2) {
        const __m512i r0 = _mm512_load_si512(c[j]), r1 = _mm512_load_si512(c[j + 1]);
        a[j] = _mm512_unpacklo_epi32(r0, r1);
        a[j + 1] = _mm512_unpackhi_epi32(r0, r1);
    }
    for (int j = 0; j < 16; j += 4) {  /* b[4q + e], lane L: column 4L + e, rows 4q .. 4q + 3 */
        b[j] = _mm512_unpacklo_epi64(a[j], a[j + 2]);
        b[j + 1] = _mm512_unpackhi_epi64(a[j], a[j + 2]);
        b[j + 2] = _mm512_unpacklo_epi64(a[j + 1], a[j + 3]);
        b[j + 3] = _mm512_unpackhi_epi64(a[j + 1], a[j + 3]);
    }
    for (int e = 0; e < 4; e++) {
        const __m512i t0 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0x44), t1 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0xee);
        const __m512i t2 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0x44);
        const __m512i t3 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0xee);
        out[e] = _mm512_castsi512_ps(_mm512_shuffle_i32x4(t0, t2, 0x88));
        out[4 + e] = _mm512_castsi512_ps(_mm512_shuffle_i32x4(t0, t2, 0xdd));
        out[8 + e] = _mm512_castsi512_ps(_mm512_shuffle_i32x4(t1, t3, 0x88));
        out[12 + e] = _mm512_castsi512_ps(_mm512_shuffle_i32x4(t1, t3, 0xdd));
    }
}

static int amx_gemm(float *y, const uint16_t *x, const uint8_t *w, int64_t M, int64_t N, int64_t K,
                    int64_t row_bytes, int type, int64_t ldy, int num_threads) {
    const int64_t tiles = (N + 31) / 32;
    int64_t cap = AMX_X_BYTES / (K * 2) / 32 * 32;  /* rows per chunk, whole pairs of groups */
    if (cap < 32) cap = 32;
    if (cap > (M + 31) / 32 * 32) cap = (M + 31) / 32 * 32;
    uint32_t *xv = aligned_alloc(64, (size_t)(K / 2 * cap * 4));  /* [K / 2][cap] pairs */
    if (xv == NULL) return 1;
    int failed = 0;
    for (int64_t m0 = 0; m0 < M; m0 += cap) {
        const int64_t mc = M - m0 < cap ? M - m0 : cap, groups = (mc + 31) / 32 * 2;
        const __m512i rows16 = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3,
                                                                   2, 1, 0), _mm512_set1_epi32((int)(K / 2)));
        for (int64_t i0 = 0; i0 < groups * 16; i0 += 16) {  /* 16 rows' pairs p at a time, zero past M */
            const __mmask16 live = mc - i0 >= 16 ? 0xffff : mc > i0 ? (__mmask16)((1u << (mc - i0)) - 1) : 0;
            const int *base = (const int *)(x + (m0 + (i0 < mc ? i0 : 0)) * K);
            for (int64_t p = 0; p < K / 2; p++)
                _mm512_store_si512(xv + p * cap + i0, _mm512_mask_i32gather_epi32(
                    _mm512_setzero_si512(), live, _mm512_add_epi32(rows16, _mm512_set1_epi32((int)p)), base, 4));
        }
        _Pragma("omp parallel num_threads(num_threads) if (num_threads > 1 && tiles > 1)")
        {
            amx_configure();
            uint16_t *wt = aligned_alloc(64, (size_t)(32 * K * 2));
            float c[4][16][16] __attribute__((aligned(64)));
            if (wt == NULL) {
                _Pragma("omp atomic write")
                failed = 1;
            }
            _Pragma("omp for schedule(static)")
            for (int64_t t = 0; t < tiles; t++) {
                if (wt == NULL) continue;
                const int64_t n0 = t * 32;
                const int nr = N - n0 < 32 ? (int)(N - n0) : 32;
                for (int j = 0; j < 32; j++)
                    for (int64_t b = 0; b < K / 32; b++)
                        _mm512_store_si512(wt + j * K + b * 32, j < nr ? block_bf16(type, w + (n0 + j) * row_bytes, b)
                                                                       : _mm512_setzero_si512());
                for (int64_t g = 0; g < groups; g += 2) {
                    amx_step(wt, K, xv, cap, g, g * 16 + 16 >= mc);
                    _tile_stored(0, c[0], 64);
                    _tile_stored(1, c[1], 64);
                    _tile_stored(2, c[2], 64);
                    _tile_stored(3, c[3], 64);
                    for (int h = 0; h < 2; h++) {  /* activation group g + h: C's columns are y's rows */
                        const int64_t first = g * 16 + h * 16;
                        const int64_t rows = mc - first < 16 ? mc - first : 16;
                        if (rows <= 0) break;
                        __m512 col[2][16];
                        transpose16(c[2 * h], col[0]);
                        if (nr > 16) transpose16(c[2 * h + 1], col[1]);
                        const __mmask16 lo = nr >= 16 ? 0xffff : (__mmask16)((1u << nr) - 1);
                        const __mmask16 hi = nr >= 32 ? 0xffff : nr > 16 ? (__mmask16)((1u << (nr - 16)) - 1) : 0;
                        for (int64_t i = 0; i < rows; i++) {
                            float *out = y + (m0 + first + i) * ldy + n0;
                            _mm512_mask_storeu_ps(out, lo, col[0][i]);
                            if (hi) _mm512_mask_storeu_ps(out + 16, hi, col[1][i]);
                        }
                    }
                }
            }
            free(wt);
            _tile_release();
        }
    }
    free(xv);
    return failed;
}
#endif

/* Whether gguf_gemm_bf16 runs here: built with AVX512_BF16 and the CPU has it. */
int gguf_bf16_supported(void) {
#if defined(__AVX512F__) && defined(__F16C__) && defined(__AVX512BF16__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") ? 1 : 0;
#else
    return 0;
#endif
}

/* y [M, N] float32 (row stride ldy) = x [M, K] bfloat16 @ bf16(dequant(w)).T, sums in float32. Returns
   nonzero, touching nothing, where the type or CPU is not served, K is not whole blocks of 32 or the
   scratch cannot be allocated. */
int gguf_gemm_bf16(float *y, const uint16_t *x, const uint8_t *w, int64_t M, int64_t N, int64_t K,
                   int64_t row_bytes, int type, int64_t ldy, int num_threads) {
#if defined(__AVX512F__) && defined(__F16C__) && defined(__AVX512BF16__)
    if (K % 32 || !(type == Q4_0 || type == Q4_1 || type == Q8_0) || !gguf_bf16_supported()) return 1;
#ifdef HAVE_AMX
    if (amx_ready()) return amx_gemm(y, x, w, M, N, K, row_bytes, type, ldy, num_threads);
#endif
    const int64_t tiles = (N + BNR - 1) / BNR;
    if (M <= BF16_FUSED_M) {
        _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && tiles >= 8)")
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * BNR;
            const int nr = N - n0 < BNR ? (int)(N - n0) : BNR;
            bf16_fused_any(type, w + n0 * row_bytes, row_bytes, x, K, y + n0, ldy, (int)M, nr);
        }
        return 0;
    }
    int64_t chunk = L2_BYTES / (K * 2);
    chunk = chunk < BMR ? BMR : chunk / BMR * BMR;
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads) if (num_threads > 1 && tiles > 1)")
    {
        uint16_t *wt = aligned_alloc(64, (size_t)(BNR * K * 2));
        if (wt == NULL) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
            const int64_t m1 = m0 + chunk < M ? m0 + chunk : M;
            _Pragma("omp for schedule(static)")
            for (int64_t t = 0; t < tiles; t++) {
                if (wt == NULL) continue;
                const int64_t n0 = t * BNR;
                const int nr = N - n0 < BNR ? (int)(N - n0) : BNR;
                for (int j = 0; j < nr; j++)
                    for (int64_t b = 0; b < K / 32; b++)
                        _mm512_store_si512(wt + j * K + b * 32, block_bf16(type, w + (n0 + j) * row_bytes, b));
                for (int64_t i = m0; i < m1; i += BMR) {
                    const int mr = m1 - i < BMR ? (int)(m1 - i) : BMR;
                    bf16_tile_any(x + i * K, K, wt, y + i * ldy + n0, ldy, mr, nr);
                }
            }
        }
        free(wt);
    }
    return failed;
#else
    (void)y; (void)x; (void)w; (void)M; (void)N; (void)K; (void)row_bytes; (void)type; (void)ldy;
    (void)num_threads;
    return 1;
#endif
}

/* The bfloat16 values of N rows (the bfloat16 path's weights, as .to(torch.bfloat16) of gguf_dequantize's):
   the prefill path's dense tile in one pass. Nonzero where the type or CPU is not served. */
int gguf_dequantize_bf16(uint16_t *dst, const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes, int type,
                         int num_threads) {
#if defined(__AVX512F__) && defined(__F16C__) && defined(__AVX512BF16__)
    if (K % 32 || !(type == Q4_0 || type == Q4_1 || type == Q8_0) || !gguf_bf16_supported()) return 1;
    _Pragma("omp parallel for num_threads(num_threads) if (num_threads > 1 && N > 64)")
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < K / 32; b++)
            _mm512_storeu_si512(dst + n * K + b * 32, block_bf16(type, w + n * row_bytes, b));
    return 0;
#else
    (void)dst; (void)w; (void)N; (void)K; (void)row_bytes; (void)type; (void)num_threads;
    return 1;
#endif
}

"""
