"""A C kernel for RMSNorm with its residual add, on the CPU.

At batch 1 a decoder layer's norm is 7 torch ops (add, pow, mean, add, rsqrt, mul, mul), each a few
microseconds of dispatch on a row of a few hundred floats; one C call replaces them. It computes in float32
in the order torch's ops do (the residual add, the squares' mean, 1/sqrt(mean + eps), x times that, times
the weight) and rounds to bfloat16 where torch's ops store bfloat16 (the residual, the normalized row before
the weight), so outputs differ from torch's only through the order of the sum of squares (fixed here: 16
lanes, then pairwise, whatever the thread count). Built with tokenmill/cpu_compile.py; `load_kernels()` is
None where no compiler works, and RMSNorm keeps its torch path.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill.cpu_compile import BF16_C, compile_or_none

_DTYPES = (torch.float32, torch.bfloat16)

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

""" + BF16_C + r"""

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* The sum of squares in one fixed order (16 lanes, then the lanes pairwise), whatever the thread count. */
static float sum_squares(const float *x, int64_t n) {
    float lane[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) lane[l] += x[i + l] * x[i + l];
    for (int l = 0; i < n; i++, l++) lane[l] += x[i] * x[i];
    for (int w = 8; w > 0; w /= 2)
        for (int l = 0; l < w; l++) lane[l] += lane[l + w];
    return lane[0];
}

/* One row: new_residual = x + residual (when given), out = norm(new_residual) * weight; float32 and
   bfloat16 have their own loops, free of branches, so that the compiler vectorizes them. */
static void norm_row_f32(float *restrict out, float *restrict res_out, const float *restrict x,
                         const float *restrict res, const float *restrict w, int64_t n, float eps, float offset) {
    if (res) for (int64_t i = 0; i < n; i++) res_out[i] = x[i] + res[i];
    const float *h = res ? res_out : x;
    const float r = 1.0f / sqrtf(sum_squares(h, n) / (float)n + eps);
    if (offset != 0.0f) for (int64_t i = 0; i < n; i++) out[i] = h[i] * r * (offset + w[i]);  /* Gemma */
    else for (int64_t i = 0; i < n; i++) out[i] = w[i] * (h[i] * r);
}

static void norm_row_bf16(uint16_t *restrict out, uint16_t *restrict res_out, const uint16_t *restrict x,
                          const uint16_t *restrict res, const uint16_t *restrict w, int64_t n, float eps,
                          float offset, float *restrict row) {
    if (res)  /* torch stores the sum in bfloat16, then normalizes that */
        for (int64_t i = 0; i < n; i++) res_out[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(res[i]));
    const uint16_t *h = res ? res_out : x;
    for (int64_t i = 0; i < n; i++) row[i] = bf16_to_f32(h[i]);
    const float r = 1.0f / sqrtf(sum_squares(row, n) / (float)n + eps);
    if (offset != 0.0f)
        for (int64_t i = 0; i < n; i++) out[i] = f32_to_bf16(row[i] * r * (offset + bf16_to_f32(w[i])));
    else  /* torch rounds the normalized row to bfloat16, then multiplies by the weight */
        for (int64_t i = 0; i < n; i++) out[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(row[i] * r));
}

/* Rows of n contiguous values, one after another. */
void rms_norm(void *out, void *res_out, const void *x, const void *res, const void *weight, int64_t rows,
              int64_t n, float eps, float offset, int is_bf16, int threads) {
    #pragma omp parallel num_threads(threads) if (rows > 1 && threads > 1)
    {
        float row[is_bf16 ? n : 1];
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; t++) {
            const int64_t o = t * n;
            if (is_bf16)
                norm_row_bf16((uint16_t *)out + o, res ? (uint16_t *)res_out + o : 0, (const uint16_t *)x + o,
                              res ? (const uint16_t *)res + o : 0, weight, n, eps, offset, row);
            else
                norm_row_f32((float *)out + o, res ? (float *)res_out + o : 0, (const float *)x + o,
                             res ? (const float *)res + o : 0, weight, n, eps, offset);
        }
    }
}
"""


@functools.cache
def load_kernels() -> ctypes.CDLL | None:
    lib = compile_or_none("cpu_norm", _SOURCE, "CPU RMSNorm: the C kernel", "using torch ops")
    if lib is None:
        return None
    lib.rms_norm.restype = None
    lib.rms_norm.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2
                             + [ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_int])
    return lib


def rms_norm_applies(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """CPU tensors of one supported dtype, contiguous (the kernels go by pointer), no autograd (no backward)."""
    return (x.dtype in _DTYPES and x.is_cpu and x.is_contiguous() and weight.dtype == x.dtype
            and weight.is_contiguous() and weight.numel() == x.shape[-1] > 0
            and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape
                                      and residual.is_contiguous()))
            and not torch.is_grad_enabled() and load_kernels() is not None)


def rms_norm_cpu(
    x: torch.Tensor,  # [..., hidden_size]
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
    offset: float,
    residual: torch.Tensor | None,  # [..., hidden_size]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (of x + residual, returned too as the new residual, when given); call rms_norm_applies() first."""
    n = x.shape[-1]
    out = torch.empty_like(x)
    new_residual = None if residual is None else torch.empty_like(x)
    load_kernels().rms_norm(
        out.data_ptr(), None if residual is None else new_residual.data_ptr(), x.data_ptr(),
        None if residual is None else residual.data_ptr(), weight.data_ptr(), x.numel() // n, n, eps, offset,
        x.dtype == torch.bfloat16, torch.get_num_threads(),
    )
    return out if residual is None else (out, new_residual)

