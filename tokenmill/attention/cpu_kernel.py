"""A C kernel for paged attention on the CPU: reads each request's keys and values in place, through its
block table, so a step never gathers or copies the context (the torch path copies it every layer).

One kernel covers every request shape the backend sees: a decode (one query), a prefill chunk, or
several new tokens after a cached context (speculative verification), each query causal at its own
position; plus sliding windows and logit soft-capping. Scores go to a per-thread scratch row, then a
max-subtracted softmax, then the weighted sum of values: float32 throughout, bfloat16 only as storage.

The source is compiled on first use with the system C compiler (`cc -O3 -march=native -fopenmp`) into
the tokenmill cache folder, keyed by a hash of the source, flags and CPU, and loaded with ctypes. Its
OpenMP calls land in the libgomp torch already loaded, so the kernel shares torch's thread pool.
`load_kernel()` is None where no compiler works: the backend then falls back to the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess

import torch

from tokenmill.cpu_compile import BF16_C, FLAGS, build_error_message, compile_library

logger = logging.getLogger(__name__)

_FLAGS = FLAGS

_SOURCE = r"""
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
/* Keys ahead to prefetch: a block of 16 ahead. A context's blocks lie anywhere in the pool, which the
   hardware prefetcher cannot follow; without this, the kernel waits on memory (2-3x slower). */
#define PREFETCH 16

/* Row `index` of a float32 or bfloat16 array as float32: in place for float32, else converted into tmp. */
static inline const float *row_f32(float *tmp, const void *base, int64_t index, int64_t D, int is_bf16) {
    if (!is_bf16) return (const float *)base + index;
    const uint16_t *src = (const uint16_t *)base + index;
    for (int64_t d = 0; d < D; d++) tmp[d] = bf16_to_f32(src[d]);
    return tmp;
}

/* One query token over the request's keys [lo, hi): query heads [h0, h1) of the token, grouped
   `groups` per kv head. Always inlined, so that each head size below gets loops of a constant trip count. */
static inline __attribute__((always_inline)) void attend(
        void *out, const void *query, const void *kc, const void *vc, const int64_t *blocks, int64_t lo,
        int64_t hi, int64_t h0, int64_t h1, int64_t groups, int64_t num_kv_heads, const int64_t D,
        int64_t block_size, float scale, float soft_cap, int is_bf16, float *scores, int64_t *slots) {
    const int64_t L = hi - lo, kv_row = num_kv_heads * D, nh = h1 - h0;
    float q[MAX_HEADS][MAX_HEAD_DIM], acc[MAX_HEADS][MAX_HEAD_DIM], tmp[MAX_HEAD_DIM], total[MAX_HEADS];
    for (int64_t b = lo / block_size, j = lo; j < hi; b++) {  /* each key's slot in the pool */
        const int64_t first = blocks[b] * block_size - b * block_size;
        for (const int64_t end = (b + 1) * block_size < hi ? (b + 1) * block_size : hi; j < end; j++)
            slots[j - lo] = first + j;
    }
    for (int64_t x = 0; x < nh; x++) {
        const float *qx = row_f32(tmp, query, (h0 + x) * D, D, is_bf16);
        for (int64_t d = 0; d < D; d++) q[x][d] = qx[d];
    }
    for (int64_t j = 0; j < L; j++) {  /* scores: q . k for each key */
        if (j + PREFETCH < L) for (int64_t c = 0; c < kv_row * (is_bf16 ? 2 : 4); c += 64)
            __builtin_prefetch((const char *)kc + slots[j + PREFETCH] * kv_row * (is_bf16 ? 2 : 4) + c);
        for (int64_t x = 0; x < nh; x++) {
            const float *k = row_f32(tmp, kc, slots[j] * kv_row + (h0 + x) / groups * D, D, is_bf16);
            float s = 0.0f;
            _Pragma("omp simd reduction(+:s)")
            for (int64_t d = 0; d < D; d++) s += q[x][d] * k[d];
            s *= scale;
            if (soft_cap > 0.0f) s = soft_cap * tanhf(s / soft_cap);
            scores[x * L + j] = s;
        }
    }
    for (int64_t x = 0; x < nh; x++) {  /* softmax numerators, in place, and their sum */
        float *s = scores + x * L, m = s[0], sum = 0.0f;
        for (int64_t j = 1; j < L; j++) m = s[j] > m ? s[j] : m;
        _Pragma("omp simd reduction(+:sum)")
        for (int64_t j = 0; j < L; j++) {
            s[j] = exp_nonpositive(s[j] - m);
            sum += s[j];
        }
        total[x] = sum;
        for (int64_t d = 0; d < D; d++) acc[x][d] = 0.0f;
    }
    for (int64_t j = 0; j < L; j++) {  /* the weighted sum of values */
        if (j + PREFETCH < L) for (int64_t c = 0; c < kv_row * (is_bf16 ? 2 : 4); c += 64)
            __builtin_prefetch((const char *)vc + slots[j + PREFETCH] * kv_row * (is_bf16 ? 2 : 4) + c);
        for (int64_t x = 0; x < nh; x++) {
            const float *v = row_f32(tmp, vc, slots[j] * kv_row + (h0 + x) / groups * D, D, is_bf16);
            const float p = scores[x * L + j];
            for (int64_t d = 0; d < D; d++) acc[x][d] += p * v[d];
        }
    }
    for (int64_t x = 0; x < nh; x++) {
        const float inv = 1.0f / total[x];
        for (int64_t d = 0; d < D; d++) {
            const float o = acc[x][d] * inv;
            if (is_bf16) ((uint16_t *)out)[(h0 + x) * D + d] = f32_to_bf16(o);
            else ((float *)out)[(h0 + x) * D + d] = o;
        }
    }
}

static void attend_any(void *out, const void *query, const void *kc, const void *vc, const int64_t *blocks,
                       int64_t lo, int64_t hi, int64_t h0, int64_t h1, int64_t groups, int64_t num_kv_heads,
                       int64_t D, int64_t block_size, float scale, float soft_cap, int is_bf16, float *scores,
                       int64_t *slots) {
    switch (D) {  /* the common head sizes, as constants */
    case 64: attend(out, query, kc, vc, blocks, lo, hi, h0, h1, groups, num_kv_heads, 64, block_size, scale, soft_cap,
                    is_bf16, scores, slots); break;
    case 128: attend(out, query, kc, vc, blocks, lo, hi, h0, h1, groups, num_kv_heads, 128, block_size, scale,
                     soft_cap, is_bf16, scores, slots); break;
    default: attend(out, query, kc, vc, blocks, lo, hi, h0, h1, groups, num_kv_heads, D, block_size, scale, soft_cap,
                    is_bf16, scores, slots);
    }
}

/* Every request's new tokens over its context: request i owns query rows [query_start_loc[i],
   query_start_loc[i + 1]), the last of them at position seq_lens[i] - 1. Returns nonzero, touching
   nothing, on shapes past the stack rows' limits. */
int paged_attention(void *out, const void *query, const void *key_cache, const void *value_cache,
                    const int64_t *block_table, const int64_t *query_start_loc, const int64_t *seq_lens,
                    int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t block_size, int64_t block_table_stride, int64_t query_stride, int64_t out_stride,
                    float scale, int64_t sliding_window, float soft_cap, int is_bf16, int num_threads) {
    const int64_t groups = num_heads / num_kv_heads, num_tokens = query_start_loc[num_reqs];
    const int64_t elem = is_bf16 ? 2 : 4;
    if (num_heads > MAX_HEADS || head_dim > MAX_HEAD_DIM) return 1;
    int64_t *token_req = malloc(sizeof(int64_t) * (num_tokens + 1)), max_len = 1;
    for (int64_t i = 0; i < num_reqs; i++) {
        for (int64_t t = query_start_loc[i]; t < query_start_loc[i + 1]; t++) token_req[t] = i;
        max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    }
    /* An item is a token with all its heads, so that each key's row (every kv head) is read once, whole;
       with fewer tokens than threads, a token's kv heads are split over items instead. */
    const int64_t splits = num_tokens < num_threads ? num_kv_heads : 1, heads_per_item = num_heads / splits;
    _Pragma("omp parallel num_threads(num_threads) if (num_threads > 1)")
    {
        float *scores = malloc(sizeof(float) * heads_per_item * max_len);
        int64_t *slots = malloc(sizeof(int64_t) * max_len);
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t item = 0; item < num_tokens * splits; item++) {
            const int64_t t = item / splits, h0 = item % splits * heads_per_item, i = token_req[t];
            const int64_t num_queries = query_start_loc[i + 1] - query_start_loc[i];
            const int64_t hi = seq_lens[i] - num_queries + (t - query_start_loc[i]) + 1;  /* causal */
            const int64_t lo = sliding_window > 0 && hi > sliding_window ? hi - sliding_window : 0;
            attend_any((char *)out + t * out_stride * elem, (const char *)query + t * query_stride * elem,
                       key_cache, value_cache, block_table + i * block_table_stride, lo, hi, h0,
                       h0 + heads_per_item, groups, num_kv_heads, head_dim, block_size, scale, soft_cap, is_bf16,
                       scores, slots);
        }
        free(scores);
        free(slots);
    }
    free(token_req);
    return 0;
}

/* The rotary embedding (the halves of each head's first rotary_dim lanes, as layers.rotary does) of
   every token's query heads into q_out and of its key heads, and the store of the rotated keys and the
   values into the pool at the tokens' slots: the torch path's dozen ops per layer, in one pass. */
void rope_and_cache(void *q_out, const void *query, const void *key, const void *value, const int64_t *positions,
                    const float *cos_sin, const int64_t *slot_mapping, void *key_cache, void *value_cache,
                    int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t rotary_dim, int64_t query_stride, int64_t key_stride, int64_t value_stride,
                    int is_bf16, int num_threads) {
    const int64_t elem = is_bf16 ? 2 : 4, half = rotary_dim / 2, kv_row = num_kv_heads * head_dim;
    _Pragma("omp parallel for num_threads(num_threads) if (num_threads > 1 && num_tokens > 64)")
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
"""

_MAX_HEADS, _MAX_HEAD_DIM = 64, 512  # the kernel's stack rows (MAX_HEADS, MAX_HEAD_DIM)
_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    try:
        lib = compile_library("paged_attention", _SOURCE, _FLAGS)
    except (OSError, subprocess.CalledProcessError) as error:
        logger.warning("CPU attention: the C kernel could not be built (%s); using the slower torch path",
                       build_error_message(error))
        return None
    lib.rope_and_cache.restype = None
    lib.rope_and_cache.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 8 + [ctypes.c_int, ctypes.c_int]
    lib.paged_attention.restype = ctypes.c_int
    lib.paged_attention.argtypes = ([ctypes.c_void_p] * 7 + [ctypes.c_int64] * 8
                                    + [ctypes.c_float, ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_int])
    return lib


def kernel_applies(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the C kernel can run this layer: CPU tensors of one supported dtype, rows of whole heads."""
    return (query.device.type == "cpu" and kv_cache.dtype == query.dtype and query.dtype in _DTYPES
            and kv_cache[0].is_contiguous() and kv_cache[1].is_contiguous()  # K and V go by pointer
            and query.stride(2) == 1 and query.stride(1) == query.shape[2]
            and query.shape[1] % kv_cache.shape[3] == 0 and query.shape[1] <= _MAX_HEADS
            and query.shape[2] <= _MAX_HEAD_DIM and load_kernel() is not None)


def paged_attention_cpu(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int64
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int64
    seq_lens: torch.Tensor,  # [num_reqs] int64
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of every request's new tokens over its cached context; call kernel_applies() first."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = query.shape[1]
    out = torch.empty(query.shape, dtype=query.dtype)
    block_table = block_table.contiguous()
    status = load_kernel().paged_attention(
        out.data_ptr(), query.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
        block_table.data_ptr(), query_start_loc.data_ptr(), seq_lens.data_ptr(),
        len(seq_lens), num_heads, num_kv_heads, head_dim, block_size, block_table.stride(0),
        query.stride(0), out.stride(0), scale, sliding_window or 0, logits_soft_cap or 0.0,
        query.dtype == torch.bfloat16, torch.get_num_threads(),
    )
    assert status == 0, "kernel_applies() admits only shapes within the kernel's limits"
    return out


def rope_and_cache_applies(layer, positions: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           max_seq_len: int) -> bool:
    """Whether rope_and_cache() can stand in for the layer's transform_qk and the KV write: a rotary
    embedding whose table covers every position, no per-head q/k norms, key and value rows of whole
    heads (the query: kernel_applies)."""
    rotary = layer.rotary_emb
    return (rotary is not None and layer.q_norm is None and layer.k_norm is None
            and rotary.cos_sin_cache.dtype == torch.float32 and rotary.rotary_dim % 2 == 0
            and max_seq_len <= rotary.cos_sin_cache.shape[0] and positions.dtype == torch.int64
            and key.dtype == value.dtype == layer.kv_cache.dtype
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (key, value)))


def rope_and_cache(
    layer,
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], the rotated query
    """The layer's rotary embedding applied to query and key, key and value stored at their slots."""
    num_tokens, num_heads, head_dim = query.shape
    rotary = layer.rotary_emb
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype)
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
    load_kernel().rope_and_cache(
        q_out.data_ptr(), query.data_ptr(), key.data_ptr(), value.data_ptr(), positions.data_ptr(),
        rotary.cos_sin_cache.data_ptr(), slot_mapping.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
        num_tokens, num_heads, key.shape[1], head_dim, rotary.rotary_dim, query.stride(0), key.stride(0),
        value.stride(0), query.dtype == torch.bfloat16, torch.get_num_threads(),
    )
    return q_out
