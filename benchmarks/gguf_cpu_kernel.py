"""The CPU GGUF kernel alone (layers.quant.gguf_cpu, float32 path): microseconds per call on the default
model's shapes, optionally against another version of the kernel's source, alternated.

    python3 benchmarks/gguf_cpu_kernel.py                                   # this tree's kernel
    git show HEAD:tokenmill/layers/quant/gguf_cpu.py > /tmp/gguf_cpu_old.py
    python3 benchmarks/gguf_cpu_kernel.py --against /tmp/gguf_cpu_old.py    # old and new, alternated

Weights are gguf's `quantize` of Gaussian values (for the K-quants, which it cannot quantize: random bytes
with float16 scales in [0.001, 0.05], since every bit pattern of their quants is valid), `--weights-mib` of
copies of each tensor called in turn (as a decode step reads a whole model's weights once: they come from
memory, not the caches; 0: one copy, cache-resident). Each figure is the fastest of `--repeats` passes over
the copies (the machine may be shared), one thread unless `--threads`. "same" says whether both kernels gave
identical outputs. Llama-3.2-1B's shapes in Q4_K_M's types:

    python3 benchmarks/gguf_cpu_kernel.py --types Q4_K,Q5_K,Q6_K --shapes 2048x2048,8192x2048,2048x8192
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quantize

from tokenmill.cpu_compile import compile_library
from tokenmill.layers.quant import gguf_cpu


def load(source: str, name: str) -> ctypes.CDLL:
    lib = compile_library(name, source)
    lib.gguf_gemm.restype = ctypes.c_int
    lib.gguf_gemm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_int, ctypes.c_int64,
                                                                             ctypes.c_int]
    return lib


# Byte offsets of the K-quants' float16 fields in a super-block.
_K_HALVES = {GGMLQuantizationType.Q4_K: (0, 2), GGMLQuantizationType.Q5_K: (0, 2), GGMLQuantizationType.Q6_K: (208,)}


def blocks_of(n: int, k: int, ggml_type: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """[n, row_bytes] uint8: gguf's quantize of Gaussian weights, or valid random K-quant super-blocks."""
    if ggml_type not in _K_HALVES:
        return quantize(rng.standard_normal((n, k)).astype(np.float32), ggml_type)
    block, block_bytes = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (n * k // block, block_bytes), dtype=np.uint8)
    for offset in _K_HALVES[ggml_type]:
        raw[:, offset:offset + 2] = rng.uniform(0.001, 0.05, len(raw)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def source_of(path: str) -> str:
    spec = importlib.util.spec_from_file_location("gguf_cpu_against", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._SOURCE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_1,Q8_0")
    parser.add_argument("--shapes", default="1536x576,576x1536,576x576,192x576,49152x576",
                        help="output x input features (the last: the LM head)")
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--weights-mib", type=float, default=110)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--against", default=None, help="another gguf_cpu.py, timed alternately")
    args = parser.parse_args()

    kernels = {"this": load(gguf_cpu._SOURCE, "gguf_gemm_bench")}
    if args.against:
        kernels["against"] = load(source_of(args.against), "gguf_gemm_bench_against")
    rng = np.random.default_rng(0)
    for type_name in args.types.split(","):
        ggml_type = GGMLQuantizationType[type_name]
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            blocks = blocks_of(n, k, ggml_type, rng)
            copies = max(1, int(args.weights_mib * 2**20 // blocks.nbytes))
            weights = [torch.from_numpy(blocks.copy()) for _ in range(copies)]
            for m in (int(v) for v in args.rows.split(",")):
                x = torch.randn(m, k)
                times = {name: [] for name in kernels}
                outputs = {}
                for repeat in range(args.repeats):
                    order = list(kernels.items())
                    for name, lib in order if repeat % 2 == 0 else order[::-1]:
                        y = torch.empty(m, n)
                        start = time.perf_counter()
                        for w in weights:
                            lib.gguf_gemm(y.data_ptr(), x.data_ptr(), w.data_ptr(), m, n, k, w.shape[1],
                                          int(ggml_type), n, args.threads)
                        times[name].append((time.perf_counter() - start) / copies)
                        outputs[name] = y
                best = {name: min(t) for name, t in times.items()}
                line = (f"{type_name} {n}x{k} rows={m}: {best['this'] * 1e6:8.1f} us "
                        f"({blocks.nbytes / best['this'] / 1e9:5.1f} GB/s)")
                if "against" in best:
                    line += (f"  against {best['against'] * 1e6:8.1f} us: {best['against'] / best['this']:.2f}x, "
                             f"same={torch.equal(outputs['this'], outputs['against'])}")
                print(line, flush=True)


if __name__ == "__main__":
    main()
