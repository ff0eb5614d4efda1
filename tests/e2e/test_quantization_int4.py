"""Integer weights (GPTQ, AWQ, compressed-tensors pack-quantized; layers.quant.w4a16) through the real engine
on the CPU, where the repacked weights are dequantized per call and multiplied in float32.

Each checkpoint is compared with its dequantized dense twin: what the checkpoint means. The twin holds exactly
the values the quantized layers compute with (integer times fp16 scale: exact in float32), so a correct reader
differs from it only in the order of float32 sums: KL ~1e-7 and full top-1 agreement. The bounds (KL < 1e-3,
top-1 >= 0.9) leave orders of magnitude for that, while any misread of the layout (a nibble order, AWQ's
interleave, GPTQ's zero offset, a group's scale) moves weights by whole quantization steps, which on these
peaked tiny models costs KL > 0.05 (measured: KL ~10 and top-1 0 for a reversed nibble order, AWQ read
without its interleave, and GPTQ v1 zeros read as v2; the tests below check that such misreads fail).
Against the unquantized model itself, round-to-nearest int4 is a real loss: reported, with a loose bound.
(On SmolLM2-135M, RTN int4 group 64 against float32 measured KL 0.31 asymmetric / 0.53 symmetric, top-1
0.64 / 0.52: a 135M model re-quantized from its Q4_1 GGUF without calibration; GPTQ and AWQ calibrate.)

The tiny models: HF's initial weights, LM head x 40 (peaked next-token distributions, as trained models
have), float32; hidden 128 and intermediate 256 so group 128 divides every K, and 4 query / 2 KV heads (GQA:
the fused QKV's parts have different widths; group sizes split only K).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.e2e.int4_checkpoints import write_int4
from tests.e2e.quant_checkpoints import TINY_TEXT, engine, tiny_model
from tests.e2e.test_quantization_fp8 import MODES, check_mode
from tests.e2e.test_quantization_fp8 import _mode_tokens as mode_tokens
from tokenmill import LLM
from tokenmill.bench.quant_quality import quant_quality
from tokenmill.layers.quant.awq import AWQ_SLOTS
from tokenmill.layers.quant.w4a16 import pack_int32, unpack_int32


def layers_of(llm: LLM):
    return llm.engine.core.executor.driver_worker.model.model.layers


def assert_matches_twin(quantized: str, dense: str) -> None:
    quality = quant_quality(engine(dense), engine(quantized), TINY_TEXT)
    print(f"{quantized.rsplit('/', 1)[-1]} vs its dequantized twin: {quality}")
    assert quality.top1_agreement >= 0.9 and quality.mean_kl < 1e-3, quality


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(hidden=128, intermediate=256), tmp_path_factory.mktemp("int4")


def test_the_published_bit_orders():
    """One word each, decoded by hand from the formats' descriptions."""
    # GPTQ and compressed-tensors: lowest bits first; 0x76543210 holds 0, 1, ..., 7.
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert unpack_int32(word, 4, dim=0).flatten().tolist() == list(range(8))
    # AWQ: slot i holds column [0, 2, 4, 6, 1, 3, 5, 7][i]; slots 7..0 read 7 5 3 1 6 4 2 0.
    assert unpack_int32(torch.tensor([[0x75316420]], dtype=torch.int32), 4, dim=1, order=AWQ_SLOTS).tolist() == [
        list(range(8))]
    # 8 bits: four per word; a word above 2^31 round-trips through int32's sign.
    values = torch.tensor([[0x01, 0x80, 0xFF, 0x7F]])
    assert unpack_int32(pack_int32(values, 8, dim=1), 8, dim=1).tolist() == values.tolist()


LAYOUTS = [
    # fmt, bits, group (0: per channel), sym, act_order, gptq version (1: zeros minus one)
    ("gptq", 4, 128, True, False, 1),
    ("gptq", 4, 32, False, True, 1),
    ("gptq", 4, 64, True, True, 0),
    ("gptq", 4, 0, False, False, 1),
    ("gptq", 8, 64, False, False, 0),
    ("awq", 4, 128, False, False, 1),
    ("awq", 4, 32, False, False, 1),
    ("ct", 4, 128, True, False, 1),
    ("ct", 4, 32, False, False, 1),
    ("ct", 8, 0, True, False, 1),
    ("ct", 4, 32, False, True, 1),
]


@pytest.mark.parametrize("fmt,bits,group,sym,act_order,version", LAYOUTS,
                         ids=[f"{f}-int{b}-g{g or 'ch'}-{'sym' if s else 'asym'}{'-act' if a else ''}-v{v}"
                              for f, b, g, s, a, v in LAYOUTS])
def test_int_checkpoints_mean_what_their_dequantized_twin_means(tiny, fmt, bits, group, sym, act_order, version):
    model, root = tiny
    quantized, dense = write_int4(model, root, fmt, bits, group, sym, act_order, version=version)
    assert_matches_twin(quantized, dense)


def _rewrite(path: str, fn) -> None:
    tensors = load_file(f"{path}/model.safetensors")
    save_file({name: fn(name, t) for name, t in tensors.items()}, f"{path}/model.safetensors")


@pytest.mark.parametrize("misread", ["gptq-nibble-order", "awq-plain-order", "gptq-zero-offset"])
def test_a_misread_layout_would_fail_these_bounds(tiny, misread):
    """The bounds above can fail: the same checkpoints, read the wrong way, are far off."""
    model, root = tiny
    fmt = misread.split("-")[0]
    quantized, dense = write_int4(model, root / misread, fmt, 4, 128, sym=False)

    def reorder(name, t):
        if misread == "gptq-nibble-order" and name.endswith("qweight"):  # highest bits first
            return pack_int32(unpack_int32(t, 4, dim=0), 4, dim=0, order=list(range(7, -1, -1)))
        if misread == "awq-plain-order" and name.endswith(("qweight", "qzeros")):  # interleave ignored
            return pack_int32(unpack_int32(t, 4, dim=1, order=AWQ_SLOTS), 4, dim=1)
        return t

    if misread == "gptq-zero-offset":  # a v1 checkpoint read as v2: every zero off by one
        config = json.loads(open(f"{quantized}/config.json").read())
        config["quantization_config"]["checkpoint_format"] = "gptq_v2"
        open(f"{quantized}/config.json", "w").write(json.dumps(config))
    else:
        _rewrite(quantized, reorder)
    quality = quant_quality(engine(dense), engine(quantized), TINY_TEXT)
    print(f"{misread}: {quality}")
    assert quality.mean_kl > 0.05, quality


@pytest.mark.parametrize("fmt", ["gptq", "gptq-dynamic", "awq", "ct"])
def test_excluded_modules_stay_dense(tiny, fmt):
    model, root = tiny
    quantized, dense = write_int4(model, root / fmt, fmt.split("-")[0], 4, 64, sym=False, skip=("down_proj",))
    if fmt == "gptq-dynamic":  # GPTQModel's negative rule instead of modules_to_not_convert
        config = json.loads(open(f"{quantized}/config.json").read())
        q = config["quantization_config"]
        del q["modules_to_not_convert"]
        q["dynamic"] = {r"-:.*\.down_proj": {}}
        open(f"{quantized}/config.json", "w").write(json.dumps(config))
    llm = engine(quantized)
    layer = layers_of(llm)[0]
    assert layer.mlp.down_proj.weight.dtype == torch.float32
    assert layer.mlp.gate_up_proj.weight_packed.dtype == torch.int32
    assert layer.self_attn.qkv_proj.weight_packed.shape == (128 + 2 * 64, 128 // 8)
    quality = quant_quality(engine(dense), llm, TINY_TEXT)
    assert quality.top1_agreement >= 0.9 and quality.mean_kl < 1e-3, quality


def test_gptq_without_g_idx(tiny):
    """Some exporters leave g_idx out where desc_act is false: the groups are sequential. Act-order needs it."""
    model, root = tiny
    for act_order in (False, True):
        quantized, dense = write_int4(model, root / "no-g-idx", "gptq", 4, 64, sym=False, act_order=act_order)
        tensors = load_file(f"{quantized}/model.safetensors")
        save_file({n: t for n, t in tensors.items() if not n.endswith(".g_idx")}, f"{quantized}/model.safetensors")
        if act_order:
            with pytest.raises(ValueError, match=r"missing weights: .*g_idx"):
                engine(quantized)
        else:
            assert_matches_twin(quantized, dense)


@pytest.mark.parametrize("num_kv_heads", [1, 4])
def test_gqa_and_mha_shapes(tmp_path, num_kv_heads):
    """MQA (one KV head: q 128 wide, k and v 32) and MHA, with act-order: the fused parts share one order."""
    model = tiny_model(seed=1, hidden=128, intermediate=256, num_kv_heads=num_kv_heads)
    quantized, dense = write_int4(model, tmp_path, "gptq", 4, 32, sym=False, act_order=True)
    assert_matches_twin(quantized, dense)


TP_LAYOUTS = [("gptq", 4, 32, False, True, 1), ("gptq", 4, 64, True, True, 0), ("gptq", 8, 32, False, True, 0),
              ("awq", 4, 32, False, False, 1), ("ct", 4, 32, False, False, 1), ("ct", 4, 64, False, True, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("fmt,bits,group,sym,act_order,version", TP_LAYOUTS,
                         ids=[f"{f}-int{b}-g{g}-{'sym' if s else 'asym'}{'-act' if a else ''}-v{v}"
                              for f, b, g, s, a, v in TP_LAYOUTS])
def test_two_tensor_parallel_ranks_mean_what_the_twin_means(tiny, fmt, bits, group, sym, act_order, version):
    """TP = 2 (gloo): weights, scales and zero points sharded together. Under row parallelism an act-order rank's
    slice of the inputs holds an uneven share of each group (here ~half of each): it keeps every group's scales and
    pads each group's features to whole groups of 32 (w4a16.VIRTUAL_GROUP), the padding's weights at the zero
    point, so o_proj and down_proj take more features than their slice has."""
    from tokenmill.bench.quant_quality import compare, prompt_distributions

    model, root = tiny
    quantized, dense = write_int4(model, root / "tp", fmt, bits, group, sym, act_order, version=version)
    twin = engine(dense)
    expected = prompt_distributions(twin, TINY_TEXT)
    twin.engine.core.shutdown()
    llm = engine(quantized, tensor_parallel_size=2)
    try:
        layer = layers_of(llm)[0]
        if act_order:
            down = layer.mlp.down_proj  # rank 0's: 128 of the 256 intermediate features
            assert down.input_perm.shape[0] > 128 and down.weight_scale.shape[1] == down.input_perm.shape[0] // 32
        quality = compare(expected, prompt_distributions(llm, TINY_TEXT))
    finally:
        llm.engine.core.shutdown()
    assert quality.top1_agreement >= 0.9 and quality.mean_kl < 1e-3, quality


def test_int4_against_the_unquantized_model(tiny):
    """What round-to-nearest int4 costs (reported; GPTQ or AWQ calibration would do better). These random
    models with a 40x LM head turn small weight errors into large logit changes (measured: KL 0.56, top-1
    0.71 at group 128 symmetric): the bound is loose enough for that, and a misread layout (KL ~10, top-1
    0) fails it."""
    model, root = tiny
    original = root / "original"
    model.save_pretrained(original)
    reference = engine(str(original))
    for fmt, group in (("gptq", 128), ("awq", 32)):
        quantized, _ = write_int4(model, root / f"vs-{fmt}", fmt, 4, group, sym=fmt == "gptq")
        quality = quant_quality(reference, engine(quantized), TINY_TEXT)
        print(f"tiny Llama {fmt} int4 g{group} (RTN) vs float32: {quality}")
        assert quality.top1_agreement >= 0.5 and quality.mean_kl < 1.5, quality


@pytest.mark.parametrize("mode", list(MODES))
def test_int_weights_give_the_same_tokens_in_every_engine_mode(tiny, mode):
    """Cached and chunked prompts, async scheduling, preempted and recomputed requests, n > 1 and verified drafts
    (test_quantization_fp8's matrix) on the layout with the most to get wrong (act order, asymmetric): a linear
    layer's rows do not depend on each other, so every mode gives the plain engine's tokens."""
    model, root = tiny
    quantized, _ = write_int4(model, root / "modes", "gptq", 4, 32, sym=False, act_order=True)
    plain, _ = mode_tokens(quantized, enable_prefix_caching=False)
    tokens, llm = mode_tokens(quantized, **MODES[mode])
    assert tokens == plain
    check_mode(llm, mode)


def test_quantization_flag_only_names_the_checkpoints_format(tiny):
    model, root = tiny
    quantized, dense = write_int4(model, root / "flag", "awq", 4, 128, sym=False)
    assert layers_of(engine(quantized, quantization="awq"))[0].mlp.down_proj.weight_packed is not None
    with pytest.raises(ValueError, match="leave --quantization out"):
        engine(quantized, quantization="gptq")
    with pytest.raises(ValueError, match="loads checkpoints quantized in that format .* and this model is not one"):
        engine(dense, quantization="gptq")


def test_compressed_tensors_targets_naming_the_unfused_projections(tiny):
    """llm-compressor recipes may target modules by name (re:...q_proj$, gate_proj) rather than "Linear": the
    fused qkv_proj and gate_up_proj are targeted through the projections they hold (such a checkpoint was
    refused: 'gate_up_proj.weight_packed has no matching parameter')."""
    model, root = tiny
    quantized, dense = write_int4(model, root / "targets", "ct", 4, 64, sym=False)
    config = json.loads(open(f"{quantized}/config.json").read())
    config["quantization_config"]["config_groups"]["group_0"]["targets"] = [
        "re:.*self_attn.(k|q|o|v)_proj$", "re:.*mlp.(down|gate|up)_proj$"]
    open(f"{quantized}/config.json", "w").write(json.dumps(config))
    assert_matches_twin(quantized, dense)


def test_compressed_tensors_sparsity_and_transforms(tiny):
    """A pruned model stored dense (sparsity_config format dense, no config_groups), or one whose transforms are
    fused into its weights, is a dense checkpoint (both were refused: 'without config_groups'). Sparse weights
    stored compressed, and transforms applied at run time (a reader that ignores them computes without the
    rotation its weights expect: wrong tokens, silently), are refused naming what."""
    from tests.e2e.quant_checkpoints import _save

    model, root = tiny
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sparsity = {"format": "dense", "sparsity_structure": "2:4", "global_sparsity": 0.5, "targets": ["Linear"],
                "ignore": ["lm_head"], "registry_requires_subclass": False}
    pruned = _save(model, root / "pruned", state, {"quant_method": "compressed-tensors", "sparsity_config": sparsity})
    # As today's compressed-tensors writes a model whose rotations (SpinQuant R1) are fused into its weights.
    fused = {"type": "hadamard", "apply": [{"targets": ["re:.*mlp.down_proj$"], "location": "weight_input"},
                                           {"targets": ["re:.*mlp.up_proj$"], "location": "weight_output",
                                            "inverse": True}]}
    rotated = _save(model, root / "rotated", state, {"quant_method": "compressed-tensors", "sparsity_config": {},
                                                     "transform_config": {"config_groups": {"R1": fused}}})
    unpruned = engine(_save(model, root / "unpruned", state, None))
    for dense in (pruned, rotated):
        quality = quant_quality(unpruned, engine(dense), TINY_TEXT)
        assert quality.top1_agreement == 1.0 and quality.mean_kl < 1e-6, quality
    quantized, _ = write_int4(model, root / "transforms", "ct", 4, 64, sym=False)
    config_file = f"{quantized}/config.json"
    written = open(config_file).read()
    for key, value, message in (
            ("sparsity_config", {**sparsity, "format": "sparse-24-bitmask"},
             "sparsity_config format 'sparse-24-bitmask'"),
            ("transform_config", {"config_groups": {"R4": {"type": "hadamard", "apply": [
                {"targets": ["re:.*down_proj$"], "location": "input"},
                {"targets": ["re:.*down_proj$"], "location": "weight_input", "inverse": True}]}}},
             r"applies transforms at run time \(input\)")):
        config = json.loads(written)
        config["quantization_config"][key] = value
        open(config_file, "w").write(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            engine(quantized)


@pytest.mark.parametrize("fmt,act_order", [("gptq", True), ("awq", False), ("ct", False), ("ct", True)])
def test_a_dummy_load_of_a_quantized_checkpoint_serves(tiny, fmt, act_order):
    """load_format dummy (random weights, to measure speed) with a quantized checkpoint's config: every
    parameter was filled with random floats, compressed-tensors' weight_shape too, whose check then refused the
    load ('weight_shape [[0, 0], ...]: not 128 input features'); the format's metadata now stays as made."""
    from tokenmill import SamplingParams

    model, root = tiny
    quantized, _ = write_int4(model, root / "dummy", fmt, 4, 32, sym=False, act_order=act_order)
    llm = engine(quantized, load_format="dummy")
    assert layers_of(llm)[0].mlp.down_proj.weight_packed.dtype == torch.int32
    out = llm.generate({"prompt_token_ids": TINY_TEXT[:5]}, SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_compressed_tensors_regexes_match_from_the_names_start(tiny):
    """compressed-tensors matches `re:` targets and ignores with re.match, from the name's start (not to its end, a
    `$` ends them): `re:.*layers.1.` ignores all of layer 1, `re:.*self_attn` targets every attention projection.
    Matched whole, layer 1's dense weights were refused ('has no matching parameter')."""
    model, root = tiny
    quantized, dense = write_int4(model, root / "prefix", "ct", 4, 64, sym=False, skip=("layers.1.",))
    config = json.loads(open(f"{quantized}/config.json").read())
    assert config["quantization_config"]["ignore"] == ["lm_head", "re:.*layers.1."]
    config["quantization_config"]["config_groups"]["group_0"]["targets"] = ["re:.*self_attn", "re:.*mlp"]
    open(f"{quantized}/config.json", "w").write(json.dumps(config))
    llm = engine(quantized)
    first, second = layers_of(llm)
    assert first.self_attn.qkv_proj.weight_packed.dtype == first.mlp.down_proj.weight_packed.dtype == torch.int32
    assert second.self_attn.qkv_proj.weight.dtype == second.mlp.down_proj.weight.dtype == torch.float32
    quality = quant_quality(engine(dense), llm, TINY_TEXT)
    assert quality.top1_agreement >= 0.9 and quality.mean_kl < 1e-3, quality
