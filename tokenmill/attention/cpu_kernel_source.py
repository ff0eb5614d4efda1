"""The C source of the CPU paged-attention kernel (attention.cpu_kernel compiles and calls it): tiles of 16 keys
read once for every query head of their KV head, AVX-512 (and AVX512_BF16) paths where the CPU has them, plain
loops the compiler vectorizes elsewhere."""

from tokenmill.cpu_compile import BF16_C

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

""" + BF16_C + r"""

/* exp(x) for x <= 0 (scores minus their max), to about 1e-7 relative: written so that the compiler
   vectorizes it, where libm's expf would run one lane at a time. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = x * 1.44269504088896341f;
    n = (n + 12582912.0f) - 12582912.0f; /* round to the nearest integer (|n| < 2^22) */
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.42860682030941723212e-6f;
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

#define MAX_HEADS 64
#define MAX_HEAD_DIM 512
#define TILE 16  /* keys a tile: one 16-lane vector of scores */
#define PREFETCH_BYTES 12288  /* measured best for rows of 3 heads of 64: 1 tile ahead in float32, 2 in bfloat16 */
#define MAX_AHEAD 4  /* tiles */
#define MAX_QUERY_BLOCK 8  /* a prompt's tokens that take each key tile together (from L1) */
#define MAX_GROUP_VECS 16  /* axpy_group_16's accumulators: G * D / 16 of them, G <= 4 */

/* Row `index` of a float32 or bfloat16 array as float32: in place for float32, else converted into tmp. */
static inline const float *row_f32(float *tmp, const void *base, int64_t index, int64_t D, int is_bf16) {
    if (!is_bf16) return (const float *)base + index;
    const uint16_t *src = (const uint16_t *)base + index;
    for (int64_t d = 0; d < D; d++) tmp[d] = bf16_to_f32(src[d]);
    return tmp;
}

/* A tile's three pieces of work, on n <= TILE key (or value) rows of one kv head as float32:
   dot_tile: s[j] = q . rows[j];  axpy_tile: acc += sum_j p[j] * rows[j];  f32_rows: bfloat16 rows as float32.
   The portable forms are loops the compiler vectorizes over the head's lanes; each dot product then ends
   in its own sum across lanes. */
static inline void dot_tile_any(float *s, const float *q, const float *const *rows, int n, int64_t D, float scale) {
    for (int j = 0; j < n; j++) {
        const float *k = rows[j];
        float sum = 0.0f;
        _Pragma("omp simd reduction(+:sum)")
        for (int64_t d = 0; d < D; d++) sum += q[d] * k[d];
        s[j] = sum * scale;
    }
}

static inline void axpy_tile_any(float *acc, const float *p, const float *const *rows, int n, int64_t D) {
    for (int j = 0; j < n; j++) {
        const float *v = rows[j], w = p[j];
        _Pragma("omp simd")
        for (int64_t d = 0; d < D; d++) acc[d] += w * v[d];
    }
}

static inline void f32_rows_any(float *dst, const uint16_t *const *src, int n, int64_t width) {
    for (int j = 0; j < n; j++)
        for (int64_t d = 0; d < width; d++) dst[j * width + d] = bf16_to_f32(src[j][d]);
}

#ifdef __AVX512F__
#include <immintrin.h>

/* With AVX-512, for head sizes of whole 16-lane vectors: a tile's 16 dot products stay 16 vectors of
   partial sums until the end, then are summed across lanes together (a transpose by shuffles, ~3
   instructions a score, against ~8 for one vector's sum alone); a tile's values go into accumulators
   held in registers. */
#define MAX_VECS (MAX_HEAD_DIM / 16)

/* Lane j of the result: the sum of p[j]'s 16 lanes. */
static inline __m512 sum_lanes_16(const __m512 *p) {
    __m512 c[8], d[4], e[2];
    for (int i = 0; i < 8; i++)  /* lanes 0-7: p[2i]'s halves added; lanes 8-15: p[2i+1]'s */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  /* 128-bit lane k: 4 partial sums of p[4i + k] */
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)  /* 128-bit lane k: 2 partial sums of p[8i + k], then 2 of p[8i + 4 + k] */
        e[i] = _mm512_add_ps(_mm512_shuffle_ps(d[2 * i], d[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(d[2 * i], d[2 * i + 1], 0xEE));
    /* lane 4k + m: the sum of p[k + 4m]; then back to p's order */
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}

static inline __attribute__((always_inline)) void dot_tile_16(float *s, const float *q, const float *const *rows,
                                                              int n, const int64_t D, float scale) {
    __m512 qv[MAX_VECS], part[TILE];
    for (int64_t c = 0; c < D / 16; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
    for (int j = 0; j < TILE; j++) {
        __m512 sum = _mm512_setzero_ps();
        if (j < n)
            for (int64_t c = 0; c < D / 16; c++) sum = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(rows[j] + 16 * c), sum);
        part[j] = sum;
    }
    _mm512_storeu_ps(s, _mm512_mul_ps(sum_lanes_16(part), _mm512_set1_ps(scale)));  /* s has room for a whole tile */
}

static inline __attribute__((always_inline)) void axpy_tile_16(float *acc, const float *p, const float *const *rows,
                                                               int n, const int64_t D) {
    __m512 a[MAX_VECS];
    for (int64_t c = 0; c < D / 16; c++) a[c] = _mm512_loadu_ps(acc + 16 * c);
    for (int j = 0; j < n; j++) {
        const __m512 w = _mm512_set1_ps(p[j]);
        for (int64_t c = 0; c < D / 16; c++) a[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(rows[j] + 16 * c), a[c]);
    }
    for (int64_t c = 0; c < D / 16; c++) _mm512_storeu_ps(acc + 16 * c, a[c]);
}

#ifdef __AVX512BF16__
/* With AVX512_BF16, a bfloat16 query's scores over bfloat16 keys straight from the pool: each instruction
   takes 32 exact products, added in float32, so the keys need no conversion. */
static inline __attribute__((always_inline)) void dot_tile_bf16(float *s, const uint16_t *q, const void *const *rows,
                                                                int n, const int64_t D, float scale) {
    __m512bh qv[MAX_VECS / 2];
    __m512 part[TILE];
    for (int64_t c = 0; c < D / 32; c++) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
    for (int j = 0; j < TILE; j++) {
        __m512 sum = _mm512_setzero_ps();
        if (j < n)
            for (int64_t c = 0; c < D / 32; c++)
                sum = _mm512_dpbf16_ps(sum, qv[c], (__m512bh)_mm512_loadu_si512((const uint16_t *)rows[j] + 32 * c));
        part[j] = sum;
    }
    _mm512_storeu_ps(s, _mm512_mul_ps(sum_lanes_16(part), _mm512_set1_ps(scale)));
}
#define BF16_DOT_BUILT 1
#else
#define BF16_DOT_BUILT 0
#define dot_tile_bf16(s, q, rows, n, D, scale) ((void)0)
#endif

/* acc (G heads' rows of D) += sum_j p[x][j] * rows[j] for the G query heads of one kv head (p[x] at
   scores + x * stride): each value row loaded (a bfloat16 row converted) once for the G heads, the G
   heads' accumulators in registers. */
static inline __attribute__((always_inline)) void axpy_group_16(float *acc, const float *scores, int64_t stride,
                                                                const void *const *rows, int n, const int64_t D,
                                                                const int G, const int is_bf16) {
    __m512 a[4][MAX_GROUP_VECS], v[MAX_GROUP_VECS];
    for (int x = 0; x < G; x++)
        for (int64_t c = 0; c < D / 16; c++) a[x][c] = _mm512_loadu_ps(acc + x * D + 16 * c);
    for (int j = 0; j < n; j++) {
        for (int64_t c = 0; c < D / 16; c++)
            v[c] = is_bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                 _mm256_loadu_si256((const __m256i *)((const uint16_t *)rows[j] + 16 * c))), 16))
                           : _mm512_loadu_ps((const float *)rows[j] + 16 * c);
        for (int x = 0; x < G; x++) {
            const __m512 w = _mm512_set1_ps(scores[x * stride + j]);
            for (int64_t c = 0; c < D / 16; c++) a[x][c] = _mm512_fmadd_ps(w, v[c], a[x][c]);
        }
    }
    for (int x = 0; x < G; x++)
        for (int64_t c = 0; c < D / 16; c++) _mm512_storeu_ps(acc + x * D + 16 * c, a[x][c]);
}

static inline void f32_rows_16(float *dst, const uint16_t *const *src, int n, int64_t width) {
    for (int j = 0; j < n; j++)
        for (int64_t d = 0; d < width; d += 16) {
            const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src[j] + d)));
            _mm512_storeu_ps(dst + j * width + d, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
        }
}
#define VEC16_BUILT 1
#else
#define VEC16_BUILT 0
#define BF16_DOT_BUILT 0
#define dot_tile_bf16(s, q, rows, n, D, scale) ((void)0)
#define dot_tile_16(s, q, rows, n, D, scale) dot_tile_any(s, q, rows, n, D, scale)
#define axpy_tile_16(acc, p, rows, n, D) axpy_tile_any(acc, p, rows, n, D)
#define axpy_group_16(acc, scores, stride, rows, n, D, G, is_bf16) ((void)0)
#define f32_rows_16(dst, src, n, width) f32_rows_any(dst, src, n, width)
#endif

/* A token's scores s over keys [0, len) whose draft-tree node i is key tree_start + i (tree_start < 0 where a
   sliding window begins among the nodes): `value` for each node whose bit in the token's `bits` is clear. Nodes
   past 63 take bit 63, as spec.tree's tree_mask does. */
static void hide_nodes(float *s, int64_t len, int64_t tree_start, int64_t bits, float value) {
    for (int64_t j = tree_start > 0 ? tree_start : 0; j < len; j++)
        if (!((bits >> (j - tree_start < 63 ? j - tree_start : 63)) & 1)) s[j] = value;
}

/* A block of nq consecutive query tokens of one request over their keys: `slots` holds the pool slot of each key
   of the block's last token, lens[u] how many of them token u sees (causal: lens rises by one a token); query
   heads [h0, h1), whole groups of `groups` heads per kv head. Keys and values go by tiles of TILE rows, each
   row read once for every head of every token of the block (a bfloat16 row converted once), so a prompt's
   tokens take their keys from L1 rather than each from L2 or L3. A token's arithmetic is the same whatever
   the block (its scores tile by tile, then their softmax, then the values). `after`: the slots of the first
   keys of the item this thread takes next, to prefetch. `tree_bits` (NULL: none) where the request verifies a
   draft tree whose nodes are its keys from index tree_start on: token u sees node i only where bit i of
   tree_bits[u] is set (besides causality). Always inlined, so that each case below gets constants. */
static inline __attribute__((always_inline)) void attend(
        void *out, int64_t out_step, const void *query, int64_t query_step, const int64_t *lens, int64_t nq,
        const void *kc, const void *vc, const int64_t *slots, const int64_t *after, int64_t after_n, int64_t h0,
        int64_t h1, int64_t groups, int64_t num_kv_heads, const int64_t D, float scale, float soft_cap,
        const int64_t *tree_bits, int64_t tree_start, const int is_bf16, const int vec16, const int bf16_dot,
        float *scratch) {
    const int64_t L = lens[nq - 1], kv_row = num_kv_heads * D, nh = h1 - h0, first = h0 / groups * D;
    const int64_t width = nh / groups * D;
    const int64_t padded = (L + TILE - 1) / TILE * TILE, elem = is_bf16 ? 2 : 4, tiles = padded / TILE;
    /* the values of a kv head's query heads in one pass, where their accumulators fit the registers */
    const int fused = VEC16_BUILT && vec16 && groups <= 4 && groups * (D / 16) <= MAX_GROUP_VECS;
    /* Prefetch about PREFETCH_BYTES ahead, a few rows each head of a tile: a context's blocks lie anywhere
       in the pool, which the hardware prefetcher cannot follow, and a tile's worth at once stalls on the
       CPU's outstanding misses. */
    const int64_t ahead_tiles = PREFETCH_BYTES / (TILE * width * elem);
    const int64_t ahead = ahead_tiles < 1 ? 1 : ahead_tiles > MAX_AHEAD ? MAX_AHEAD : ahead_tiles;
    /* per token u: q and acc at u * nh * D, scores at u * nh * padded */
    float *q = scratch, *acc = q + nq * nh * D, *scores = acc + nq * nh * D, *tile = scores + nq * nh * padded;
    float total[MAX_QUERY_BLOCK][MAX_HEADS];
    for (int64_t u = 0; u < nq; u++) {
        const char *qu = (const char *)query + u * query_step;
        for (int64_t x = 0; x < nh; x++) {
            for (int64_t d = 0; d < D; d++) {
                const int64_t at = (h0 + x) * D + d;
                q[(u * nh + x) * D + d] = is_bf16 ? bf16_to_f32(((const uint16_t *)qu)[at]) : ((const float *)qu)[at];
                acc[(u * nh + x) * D + d] = 0.0f;
            }
        }
    }
    for (int pass = 0; pass < 2; pass++) {  /* 0: the scores over the keys; 1: the weighted sum of values */
        const char *cache = pass ? vc : kc;
        for (int64_t j0 = 0; j0 < L; j0 += TILE) {
            const int n = L - j0 < TILE ? (int)(L - j0) : TILE;
            /* The tile `ahead` tiles on, in the order: keys, values, the next item's first keys (`after`) */
            const int64_t u_ahead = pass * tiles + j0 / TILE + ahead, in_item = u_ahead < 2 * tiles;
            const char *next = u_ahead >= tiles && in_item ? vc : kc;
            const int64_t *next_slots = in_item ? slots + u_ahead % tiles * TILE : after + (u_ahead - 2 * tiles) * TILE;
            const int64_t left = in_item ? L - u_ahead % tiles * TILE : after_n - (u_ahead - 2 * tiles) * TILE;
            const int64_t next_n = left < 0 ? 0 : left < TILE ? left : TILE;
            /* The tile's rows at the item's first kv head: in the pool, or converted from bfloat16 into `tile`
               where what reads them takes float32. */
            const char *raw[TILE];
            const void *rows[TILE];
            for (int j = 0; j < n; j++) raw[j] = cache + (slots[j0 + j] * kv_row + first) * elem;
            const int convert = is_bf16 && !(pass ? fused : bf16_dot);
            if (convert && vec16) f32_rows_16(tile, (const uint16_t *const *)raw, n, width);
            else if (convert) f32_rows_any(tile, (const uint16_t *const *)raw, n, width);
            for (int64_t u = 0; u < nq; u++) {
                if (lens[u] <= j0) continue;  /* past this token's last key */
                const int nu = lens[u] - j0 < n ? (int)(lens[u] - j0) : n;
                const char *qu = (const char *)query + u * query_step;
                /* the next rows to prefetch spread over the heads: head x takes [x * next_n / nh, (x + 1) *
                   next_n / nh), counted without a division (a division per head and tile showed) */
                int64_t pf_next = 0, pf_acc = 0;
                for (int64_t x = 0, kv = 0, in_group = 0; x < nh; x++) {
                    if (u == nq - 1) {  /* prefetches over the heads of the token seeing every key: see `ahead` */
                        const int64_t pf_first = pf_next;
                        for (pf_acc += next_n; pf_acc >= nh; pf_acc -= nh) pf_next++;
                        for (int64_t j = pf_first; j < pf_next; j++)
                            for (int64_t c = 0; c < width * elem; c += 64)
                                __builtin_prefetch(next + (next_slots[j] * kv_row + first) * elem + c);
                    }
                    if (in_group == 0)  /* the rows of this kv head */
                        for (int j = 0; j < nu; j++)
                            rows[j] = convert ? (const void *)(tile + j * width + kv * D)
                                              : (const void *)(raw[j] + kv * D * elem);
                    const float *const *f32_rows = (const float *const *)rows;
                    float *s = scores + (u * nh + x) * padded + j0, *a = acc + (u * nh + x) * D;
                    if (!pass && bf16_dot)
                        dot_tile_bf16(s, (const uint16_t *)qu + (h0 + x) * D, rows, nu, D, scale);
                    else if (!pass && vec16) dot_tile_16(s, q + (u * nh + x) * D, f32_rows, nu, D, scale);
                    else if (!pass) dot_tile_any(s, q + (u * nh + x) * D, f32_rows, nu, D, scale);
                    else if (fused && in_group == 0) {  /* the kv head's query heads together */
                        if (groups == 1) axpy_group_16(a, s, padded, rows, nu, D, 1, is_bf16);
                        else if (groups == 2) axpy_group_16(a, s, padded, rows, nu, D, 2, is_bf16);
                        else if (groups == 3) axpy_group_16(a, s, padded, rows, nu, D, 3, is_bf16);
                        else axpy_group_16(a, s, padded, rows, nu, D, 4, is_bf16);
                    } else if (fused) {}
                    else if (vec16) axpy_tile_16(a, s, f32_rows, nu, D);
                    else axpy_tile_any(a, s, f32_rows, nu, D);
                    if (++in_group == groups) in_group = 0, kv++;
                }
            }
        }
        if (pass) break;
        for (int64_t u = 0; u < nq; u++) {
            const int64_t Lu = lens[u];
            for (int64_t x = 0; x < nh; x++) {  /* softmax numerators, in place, and their sum */
                float *s = scores + (u * nh + x) * padded, m = -INFINITY, sum = 0.0f;
                if (soft_cap > 0.0f)
                    for (int64_t j = 0; j < Lu; j++) s[j] = soft_cap * tanhf(s[j] / soft_cap);
                if (tree_bits) hide_nodes(s, Lu, tree_start, tree_bits[u], -INFINITY);
                _Pragma("omp simd reduction(max:m)")
                for (int64_t j = 0; j < Lu; j++) m = s[j] > m ? s[j] : m;
                _Pragma("omp simd reduction(+:sum)")
                for (int64_t j = 0; j < Lu; j++) {
                    s[j] = exp_nonpositive(s[j] - m);
                    sum += s[j];
                }
                /* exp_nonpositive clamps -inf to a weight of ~1e-38: too small for the sum (>= 1, the max's
                   own), not for a value row */
                if (tree_bits) hide_nodes(s, Lu, tree_start, tree_bits[u], 0.0f);
                total[u][x] = sum;
            }
        }
    }
    for (int64_t u = 0; u < nq; u++) {
        char *ou = (char *)out + u * out_step;
        for (int64_t x = 0; x < nh; x++) {
            const float inv = 1.0f / total[u][x];
            for (int64_t d = 0; d < D; d++) {
                const float o = acc[(u * nh + x) * D + d] * inv;
                if (is_bf16) ((uint16_t *)ou)[(h0 + x) * D + d] = f32_to_bf16(o);
                else ((float *)ou)[(h0 + x) * D + d] = o;
            }
        }
    }
}

/* Floats of scratch attend needs, for an item of nq tokens of nh heads over at most max_len keys. */
static int64_t scratch_floats(int64_t nq, int64_t nh, int64_t groups, int64_t D, int64_t max_len) {
    return nq * (2 * nh * D + nh * ((max_len + TILE - 1) / TILE * TILE)) + TILE * (nh / groups) * D;
}

#define ATTEND(D_, BF16_, VEC16_, BF16_DOT_) attend(out, out_step, query, query_step, lens, nq, kc, vc, slots, after, \
                                                    after_n, h0, h1, groups, num_kv_heads, D_, scale, soft_cap, \
                                                    tree_bits, tree_start, BF16_, VEC16_, BF16_DOT_, scratch)

static void attend_any(void *out, int64_t out_step, const void *query, int64_t query_step, const int64_t *lens,
                       int64_t nq, const void *kc, const void *vc, const int64_t *slots, const int64_t *after,
                       int64_t after_n, int64_t h0, int64_t h1, int64_t groups, int64_t num_kv_heads, int64_t D,
                       float scale, float soft_cap, const int64_t *tree_bits, int64_t tree_start, int is_bf16,
                       float *scratch) {
    const int bf16_dot = is_bf16 && BF16_DOT_BUILT && D % 32 == 0;
    if (VEC16_BUILT && D == 64) {  /* the common sizes, as constants */
        if (bf16_dot) ATTEND(64, 1, 1, 1);
        else if (is_bf16) ATTEND(64, 1, 1, 0);
        else ATTEND(64, 0, 1, 0);
    } else if (VEC16_BUILT && D == 128) {
        if (bf16_dot) ATTEND(128, 1, 1, 1);
        else if (is_bf16) ATTEND(128, 1, 1, 0);
        else ATTEND(128, 0, 1, 0);
    } else if (VEC16_BUILT && D % 16 == 0) {
        if (bf16_dot) ATTEND(D, 1, 1, 1);
        else if (is_bf16) ATTEND(D, 1, 1, 0);
        else ATTEND(D, 0, 1, 0);
    } else if (is_bf16) ATTEND(D, 1, 0, 0);
    else ATTEND(D, 0, 0, 0);
}

/* Which vector paths this build has (bit 0: AVX-512 tiles; bit 1: AVX512_BF16 dot products), for the tests. */
int kernel_paths(void) { return VEC16_BUILT | BF16_DOT_BUILT << 1; }

/* Token t's keys [lo, hi) (causal at its position, within the sliding window): the pool slots of the first
   `limit` of them into slots; returns how many. */
static int64_t key_slots(int64_t *slots, int64_t *lo, int64_t *hi, int64_t t, const int64_t *token_req,
                         const int64_t *query_start_loc, const int64_t *seq_lens, const int64_t *block_table,
                         int64_t block_table_stride, int64_t block_size, int64_t sliding_window, int64_t limit) {
    const int64_t i = token_req[t], num_queries = query_start_loc[i + 1] - query_start_loc[i];
    const int64_t *blocks = block_table + i * block_table_stride;
    *hi = seq_lens[i] - num_queries + (t - query_start_loc[i]) + 1;
    *lo = sliding_window > 0 && *hi > sliding_window ? *hi - sliding_window : 0;
    const int64_t stop = *hi - *lo < limit ? *hi : *lo + limit;
    for (int64_t b = *lo / block_size, j = *lo; j < stop; b++) {
        const int64_t start = blocks[b] * block_size - b * block_size;
        for (const int64_t end = (b + 1) * block_size < stop ? (b + 1) * block_size : stop; j < end; j++)
            slots[j - *lo] = start + j;
    }
    return stop - *lo;
}

/* Every request's new tokens over its context: request i owns query rows [query_start_loc[i],
   query_start_loc[i + 1]), the last of them at position seq_lens[i] - 1. With tree_lens (NULL: no draft trees)
   request i's last tree_lens[i] keys are draft-tree nodes, and query token t sees node j of them only where bit j
   of tree_bits[t] is set (spec.tree). Returns nonzero, touching nothing, on shapes past the stack rows' limits. */
int paged_attention(void *out, const void *query, const void *key_cache, const void *value_cache,
                    const int64_t *block_table, const int64_t *query_start_loc, const int64_t *seq_lens,
                    int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t block_size, int64_t block_table_stride, int64_t query_stride, int64_t out_stride,
                    float scale, int64_t sliding_window, float soft_cap, int is_bf16, int num_threads,
                    const int64_t *tree_lens, const int64_t *tree_bits) {
    const int64_t groups = num_heads / num_kv_heads, num_tokens = query_start_loc[num_reqs];
    const int64_t elem = is_bf16 ? 2 : 4;
    if (num_heads > MAX_HEADS || head_dim > MAX_HEAD_DIM) return 1;
    int64_t *token_req = malloc(sizeof(int64_t) * (num_tokens + 1)), max_len = 1;
    for (int64_t i = 0; i < num_reqs; i++) {
        for (int64_t t = query_start_loc[i]; t < query_start_loc[i + 1]; t++) token_req[t] = i;
        max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    }
    /* An item is a block of up to MAX_QUERY_BLOCK consecutive tokens of one request with all their heads, so
       that each key's row (every kv head) is read once, whole, for the block (a sliding window gives each
       token keys of its own: blocks of one); with fewer items than threads, an item's kv heads are split over
       items instead. */
    const int64_t per_block = sliding_window > 0 ? 1 : MAX_QUERY_BLOCK;
    int64_t *block_first = malloc(sizeof(int64_t) * (num_tokens + 1)), num_blocks = 0;
    for (int64_t i = 0; i < num_reqs; i++)
        for (int64_t t = query_start_loc[i]; t < query_start_loc[i + 1]; t += per_block) block_first[num_blocks++] = t;
    block_first[num_blocks] = num_tokens;  /* blocks are consecutive: each ends where the next begins */
    const int64_t splits = num_blocks < num_threads ? num_kv_heads : 1, heads_per_item = num_heads / splits;
    const int64_t nq_max = num_tokens < per_block ? (num_tokens > 0 ? num_tokens : 1) : per_block;
    _Pragma("omp parallel num_threads(num_threads) if (num_threads > 1)")
    {
        float *scratch = malloc(sizeof(float) * scratch_floats(nq_max, heads_per_item, groups, head_dim, max_len));
        int64_t *slots = malloc(sizeof(int64_t) * max_len), after[MAX_AHEAD * TILE], lens[MAX_QUERY_BLOCK];
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t item = 0; item < num_blocks * splits; item++) {
            const int64_t b = item / splits, h0 = item % splits * heads_per_item;
            const int64_t t0 = block_first[b], nq = block_first[b + 1] - t0;
            int64_t lo, hi, after_n = 0, after_lo, after_hi;
            key_slots(slots, &lo, &hi, t0 + nq - 1, token_req, query_start_loc, seq_lens, block_table,
                      block_table_stride, block_size, sliding_window, max_len);
            for (int64_t u = 0; u < nq; u++) lens[u] = hi - lo - (nq - 1 - u);  /* causal: one key fewer a token */
            const int64_t req = token_req[t0], tree_len = tree_lens ? tree_lens[req] : 0;
            /* The item this thread likely takes next (exactly, on one thread): its first keys. */
            if (item + num_threads < num_blocks * splits)
                after_n = key_slots(after, &after_lo, &after_hi, block_first[(item + num_threads) / splits], token_req,
                                    query_start_loc, seq_lens, block_table, block_table_stride, block_size,
                                    sliding_window, MAX_AHEAD * TILE);
            attend_any((char *)out + t0 * out_stride * elem, out_stride * elem,
                       (const char *)query + t0 * query_stride * elem, query_stride * elem, lens, nq, key_cache,
                       value_cache, slots, after, after_n, h0, h0 + heads_per_item, groups, num_kv_heads, head_dim,
                       scale, soft_cap, tree_len ? tree_bits + t0 : NULL, seq_lens[req] - tree_len - lo, is_bf16,
                       scratch);
        }
        free(scratch);
        free(slots);
    }
    free(block_first);
    free(token_req);
    return 0;
}

/* The rotary embedding (the halves of each head's first rotary_dim lanes, as layers.rotary does) of
   every token's query heads into q_out and of its key heads, and the store of the rotated keys and the
   values into the pool at the tokens' slots: the torch path's dozen ops per layer, in one pass. Over the
   threads from a decode batch of 16: a token's first write to a block can fault a fresh page of the pool in, and
   in a virtual machine (Firecracker) a fault costs ~10 us; serial, they made this 0.56 ms of a 64-row step's
   layer (0.12 with the pool pre-touched), over two threads 0.31. */
void rope_and_cache(void *q_out, const void *query, const void *key, const void *value, const int64_t *positions,
                    const float *cos_sin, const int64_t *slot_mapping, void *key_cache, void *value_cache,
                    int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t rotary_dim, int64_t query_stride, int64_t key_stride, int64_t value_stride,
                    int is_bf16, int num_threads) {
    const int64_t elem = is_bf16 ? 2 : 4, half = rotary_dim / 2, kv_row = num_kv_heads * head_dim;
    _Pragma("omp parallel for num_threads(num_threads) if (num_threads > 1 && num_tokens >= 16)")
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *cos = cos_sin + positions[t] * rotary_dim, *sin = cos + half;
        float tmp[MAX_HEAD_DIM], rotated[MAX_HEAD_DIM];
        for (int64_t x = 0; x < num_heads + num_kv_heads; x++) {
            const int is_query = x < num_heads, head = is_query ? x : x - num_heads;
            const char *src = is_query ? (const char *)query + (t * query_stride + head * head_dim) * elem
                                       : (const char *)key + (t * key_stride + head * head_dim) * elem;
            const float *in = row_f32(tmp, src, 0, head_dim, is_bf16);
            for (int64_t d = 0; d < half; d++) {
                rotated[d] = in[d] * cos[d] - in[d + half] * sin[d];
                rotated[d + half] = in[d + half] * cos[d] + in[d] * sin[d];
            }
            for (int64_t d = rotary_dim; d < head_dim; d++) rotated[d] = in[d];
            char *dst = is_query ? (char *)q_out + (t * num_heads + head) * head_dim * elem
                                 : (char *)key_cache + (slot_mapping[t] * kv_row + head * head_dim) * elem;
            for (int64_t d = 0; d < head_dim; d++) {
                if (is_bf16) ((uint16_t *)dst)[d] = f32_to_bf16(rotated[d]);
                else ((float *)dst)[d] = rotated[d];
            }
        }
        memcpy((char *)value_cache + slot_mapping[t] * kv_row * elem, (const char *)value + t * value_stride * elem,
               kv_row * elem);
    }
}

/* A layer's attention where rope_and_cache applies: the rotated queries into a scratch of their own, then
   paged_attention over them (draft trees' masks as it takes them). One call instead of two: at batch 1 each call's
   Python (its checks, the argument conversions, the query's allocation) costs more than its work. Returns nonzero,
   touching nothing, where paged_attention would, or where the scratch cannot be had. */
int rope_cache_attention(void *out, const void *query, const void *key, const void *value, const int64_t *positions,
                         const float *cos_sin, const int64_t *slot_mapping, void *key_cache, void *value_cache,
                         const int64_t *block_table, const int64_t *query_start_loc, const int64_t *seq_lens,
                         int64_t num_reqs, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t rotary_dim, int64_t block_size, int64_t block_table_stride,
                         int64_t query_stride, int64_t key_stride, int64_t value_stride, int64_t out_stride,
                         float scale, int64_t sliding_window, float soft_cap, int is_bf16, int num_threads,
                         const int64_t *tree_lens, const int64_t *tree_bits) {
    if (num_heads > MAX_HEADS || head_dim > MAX_HEAD_DIM) return 1;
    const int64_t q_row = num_heads * head_dim;
    void *rotated = malloc((size_t)((num_tokens > 0 ? num_tokens : 1) * q_row * (is_bf16 ? 2 : 4)));
    if (rotated == NULL) return 1;
    rope_and_cache(rotated, query, key, value, positions, cos_sin, slot_mapping, key_cache, value_cache, num_tokens,
                   num_heads, num_kv_heads, head_dim, rotary_dim, query_stride, key_stride, value_stride, is_bf16,
                   num_threads);
    const int status = paged_attention(out, rotated, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                                       num_reqs, num_heads, num_kv_heads, head_dim, block_size, block_table_stride,
                                       q_row, out_stride, scale, sliding_window, soft_cap, is_bf16, num_threads,
                                       tree_lens, tree_bits);
    free(rotated);
    return status;
}
"""
