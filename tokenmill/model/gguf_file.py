"""A GGUF file's header, read directly: its metadata and its tensors as numpy views of the mapped file.

gguf's GGUFReader builds a numpy view for every part of every metadata field, each vocabulary entry and merge
included: ~2.8 s for SmolLM2-135M's 49,152 tokens on one core, paid by every process that loads the model. Here
the metadata is read with `struct` (arrays of strings are skipped over, their lengths kept) in ~0.1 s, and the
tensors are laid out exactly as GGUFReader lays them out (quantized types as [..., row bytes] uint8, the others
as their numpy type), so `gguf.dequantize` and the rest of the loader take them unchanged.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

DEFAULT_ALIGNMENT = 32
"""gguf.GGUF_DEFAULT_ALIGNMENT, when the file names no general.alignment."""

# GGUF metadata value types (gguf.GGUFValueType) of fixed size -> struct format
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

# GGML types stored as plain numbers (gguf.GGMLQuantizationType) -> numpy type; the others are blocks of bytes.
_PLAIN_TYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


class ArrayInfo(NamedTuple):
    """A metadata array, not decoded: its item type (a GGUF value type) and length."""

    item_type: int
    count: int


class GGUFTensor(NamedTuple):
    """The fields of gguf's ReaderTensor that the loader reads."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the innermost dimension first
    data: np.ndarray


class GGUFHeader(NamedTuple):
    metadata: dict[str, object]  # numbers, booleans and strings as values; arrays as ArrayInfo
    tensors: list[GGUFTensor]


def read_header(path: str) -> GGUFHeader:
    """The metadata and the tensors (views of the file mapped read-only: nothing is copied)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    data = np.memmap(path, mode="r")
    parser = _Parser(path, data)
    metadata = parser.metadata()
    infos = [parser.tensor_info() for _ in range(parser.tensor_count)]
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path!r}: general.alignment {alignment!r} is not a power of two")
    start = -(-parser.offset // alignment) * alignment
    tensors, seen = [], set()
    for name, dims, raw_type, offset in infos:
        if name in seen:
            raise ValueError(f"{path!r} holds the tensor {name!r} twice")
        seen.add(name)
        ggml_type = GGMLQuantizationType(raw_type)
        shape = tuple(reversed(dims))
        if raw_type in _PLAIN_TYPES:
            dtype = np.dtype(_PLAIN_TYPES[raw_type]).newbyteorder(parser.order)
        else:
            dtype, shape = np.dtype(np.uint8), quant_shape_to_byte_shape(shape, ggml_type)
        begin = start + offset
        end = begin + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end > len(data):
            raise ValueError(f"{path!r} ends at byte {len(data):,}, inside tensor {name!r} (to byte {end:,}): "
                             "the file is cut off")
        tensors.append(GGUFTensor(name, ggml_type, dims, data[begin:end].view(dtype).reshape(shape)))
    return GGUFHeader(metadata, tensors)


class _Parser:
    """Reads the header's fields in order from a buffer of the file."""

    def __init__(self, path: str, buf) -> None:
        self.path, self.buf = path, buf
        magic, version = struct.unpack_from("<4sI", buf, 0)
        if magic != b"GGUF" or version & 0xFFFF == 1:
            raise ValueError(f"{path!r} is not a GGUF file of version 2 or later (GGUF magic invalid)")
        self.order = ">" if version & 0xFFFF == 0 else "<"  # a big-endian file reads its version byte-swapped
        self.offset = 8
        self.tensor_count = self.unpack("Q")
        self.kv_count = self.unpack("Q")

    def unpack(self, fmt: str):
        fmt = self.order + fmt
        value = struct.unpack_from(fmt, self.buf, self.offset)[0]
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("Q")
        value = bytes(self.buf[self.offset:self.offset + length]).decode("utf-8", errors="replace")
        self.offset += length
        return value

    def skip_array(self) -> ArrayInfo:
        item_type, count = self.unpack("I"), self.unpack("Q")
        if item_type in _FIXED:
            self.offset += count * struct.calcsize(_FIXED[item_type])
        elif item_type == _STRING:
            for _ in range(count):
                self.offset += 8 + struct.unpack_from(self.order + "Q", self.buf, self.offset)[0]
        else:
            for _ in range(count):
                self.skip_array()
        return ArrayInfo(item_type, count)

    def metadata(self) -> dict[str, object]:
        values: dict[str, object] = {}
        for _ in range(self.kv_count):
            key = self.string()
            value_type = self.unpack("I")
            if value_type in _FIXED:
                values[key] = self.unpack(_FIXED[value_type])
            elif value_type == _STRING:
                values[key] = self.string()
            elif value_type == _ARRAY:
                values[key] = self.skip_array()
            else:
                raise ValueError(f"{self.path!r}: metadata {key!r} has an unknown GGUF value type {value_type}")
        return values

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string()
        dims = tuple(self.unpack("Q") for _ in range(self.unpack("I")))
        return name, dims, self.unpack("I"), self.unpack("Q")
