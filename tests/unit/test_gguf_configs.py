"""Config fields of GGUF files that transformers' GGUF reader leaves at its classes' defaults, read the way
llama.cpp reads them (model/gguf_config.py). The files hold metadata only: the config comes from it alone."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from tokenmill.config import ModelConfig
from tokenmill.model.loader import load_hf_config


def write_gemma2_header(path: str, layers: int, hidden: int, heads: int, head_dim: int) -> None:
    writer = gguf.GGUFWriter(path, "gemma2")
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(4 * hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads // 2)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(256000)
    writer.add_sliding_window(4096)
    writer.add_float32("gemma2.attn_logit_softcapping", 40.0)  # not Gemma2Config's defaults (50, 30)
    writer.add_float32("gemma2.final_logit_softcapping", 20.0)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("layers", "hidden", "heads", "head_dim", "scalar"),
                         [(46, 4608, 32, 128, 144),  # Gemma-2-27B: hidden / heads, not its head_dim
                          (26, 2304, 8, 256, 256)])  # Gemma-2-2B: head_dim
def test_gemma2_query_scale_and_soft_caps(tmp_path, layers, hidden, heads, head_dim, scalar):
    path = str(tmp_path / "gemma2.gguf")
    write_gemma2_header(path, layers, hidden, heads, head_dim)
    config = load_hf_config(ModelConfig(path))
    assert config.query_pre_attn_scalar == scalar
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (40.0, 20.0)
    assert config.sliding_window == 4096
