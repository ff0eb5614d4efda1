"""C kernels for the CPU, compiled on first use with the system C compiler and loaded with ctypes.

A library is built into the tokenmill cache folder, keyed by a hash of its source, the flags and the CPU
(a -march=native build must not be reused on another CPU), so a process builds it once per machine and
source version. OpenMP calls land in the libgomp torch already loaded: kernels share torch's thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno", "-std=c11"]


def cpu_signature() -> str:
    """The CPU's model and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def cpu_flags() -> set[str]:
    """The CPU's feature flags (as /proc/cpuinfo names them); empty where /proc/cpuinfo cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def _build(path: str, source_text: str, flags: list[str]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
        source = os.path.join(tmp, "kernel.c")
        with open(source, "w") as f:
            f.write(source_text)
        built = os.path.join(tmp, "kernel.so")
        compiler = os.environ.get("CC", "cc")
        subprocess.run([compiler, *flags, source, "-o", built], check=True, capture_output=True, text=True)
        os.replace(built, path)  # atomic: processes building at once each install a whole file


def compile_library(name: str, source: str, flags: list[str] = FLAGS) -> ctypes.CDLL:
    """The library built from `source`; raises OSError or subprocess.CalledProcessError where no compiler
    works (callers fall back to torch and say so: build_error_message)."""
    from tokenmill.default_model import cache_dir

    key = hashlib.sha256("\0".join([source, *flags, cpu_signature()]).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir(), "cpu_kernels", f"{name}_{key}.so")
    if not os.path.exists(path):
        _build(path, source, flags)
    return ctypes.CDLL(path)


def compile_or_none(name: str, source: str, what: str, fallback: str, flags: list[str] = FLAGS) -> ctypes.CDLL | None:
    """compile_library's library, or None where no compiler builds it, logged as "`what` could not be built (the
    compiler's error); `fallback`" (what the caller does instead)."""
    try:
        return compile_library(name, source, flags)
    except (OSError, subprocess.CalledProcessError) as error:
        logger.warning("%s could not be built (%s); %s", what, build_error_message(error), fallback)
        return None


def build_error_message(error: Exception) -> str:
    """The compiler's first error line (else its last line, or the error itself)."""
    lines = str(getattr(error, "stderr", None) or error).strip().splitlines()
    errors = [line for line in lines if "error" in line]  # gcc's last line is often a caret under code
    return (errors or lines or [repr(error)])[0 if errors else -1]


BF16_C = r"""
static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
"""
"""C helpers for the kernels' sources (after stdint.h and string.h): bfloat16 <-> float32 as torch converts."""

AMX_C = r"""
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static int amx_ready(void) {  /* Linux hands AMX's state to a process that asks (once) */
    static int state = 0;  /* 0 unknown, 1 yes, -1 no */
    int s;
    _Pragma("omp atomic read")
    s = state;
    if (s == 0) {
        s = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : -1;
        _Pragma("omp atomic write")
        state = s;
    }
    return s > 0;
}

/* This thread's tiles: all eight 16 rows of 64 bytes. */
static inline void amx_configure(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}
"""
"""C helpers for AMX kernels (after immintrin.h, string.h, sys/syscall.h and unistd.h): the permission request
and the one tile shape the kernels use."""
