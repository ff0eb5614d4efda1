"""model.gguf_file reads a GGUF header as gguf's own GGUFReader does: the same metadata values, the same tensors
(names, types, shapes, bytes), in either byte order and at any alignment; a cut-off file is said in a line."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter, quantize

from tokenmill.model.gguf_file import ArrayInfo, read_header

TOKENS = ["<s>", "hello", " wörld", "", "\n"] * 40


def write(path, endianess=GGUFEndian.LITTLE, alignment=None) -> None:
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama", endianess=endianess)
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_string("general.name", "tiny ünïcode")
    writer.add_int64("llama.some_int64", -(2**40))
    writer.add_token_list(TOKENS)
    writer.add_token_scores([float(i) for i in range(len(TOKENS))])
    writer.add_array("llama.nested", [[1, 2], [3]])
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_tensor("a.f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("b.f16", rng.standard_normal((4, 2, 6)).astype(np.float16))
    for name, ggml_type in (("c.q8_0", GGMLQuantizationType.Q8_0), ("d.q4_0", GGMLQuantizationType.Q4_0),
                            ("e.bf16", GGMLQuantizationType.BF16)):
        values = rng.standard_normal((6, 64)).astype(np.float32)
        writer.add_tensor(name, quantize(values, ggml_type), raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("endianess", "alignment"), [(GGUFEndian.LITTLE, None), (GGUFEndian.LITTLE, 64),
                                                      (GGUFEndian.BIG, None)], ids=["little", "aligned-64", "big"])
def test_the_header_is_what_ggufs_reader_reads(tmp_path, endianess, alignment):
    path = tmp_path / "tiny.gguf"
    write(path, endianess, alignment)
    reader = GGUFReader(str(path))
    header = read_header(str(path))
    expected = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            # gguf's reader counts a nested array's innermost items; its length is that of the outer list
            count = 2 if key == "llama.nested" else len(field.contents())
            expected[key] = ArrayInfo(int(field.types[1]), count)
        else:
            value = field.contents()
            expected[key] = pytest.approx(value) if isinstance(value, float) else value
    assert header.metadata == expected
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(header.tensors, reader.tensors):
        assert ours.tensor_type == theirs.tensor_type and ours.shape == tuple(theirs.shape.tolist())
        assert ours.data.shape == theirs.data.shape and ours.data.dtype == theirs.data.dtype
        assert np.array_equal(ours.data, theirs.data)


def test_a_cut_off_file_is_said_in_a_line(tmp_path):
    path = tmp_path / "tiny.gguf"
    write(path)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ValueError, match="cut off"):
        read_header(str(path))
    path.write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_header(str(path))
