"""LoRA's outside, on `tiny`. --quantize, QLoRA's frozen base: Keras's weight-only int8 (and int4) under
float32 LoRA adapters: the base is its abs-max rounding, the sharded step equals one device's, the saved model
is the adapters merged into the unquantized base, and what cannot be quantized is refused in one line. The
adapters in PEFT's files: PEFT's update equals the merged --export-hf checkpoint's, module by module."""

import json
import os

import numpy as np
import pytest

import common
import interop
import lora
import jax
import jax.numpy as jnp
import keras_hub
import sft
from helpers import ROOT, run_script, usage_error
from test_sharding import run_steps, single_device_mesh

IDS = np.random.default_rng(0).integers(3, 300, (4, 24)).astype(np.int32)


def logits_of(model, ids=IDS):
    params, frozen = common.split_variables(model.backbone)
    hidden, _ = common.forward(model.backbone, params, frozen, ids, np.ones_like(ids, bool))
    with common.weights(model.backbone, params, frozen):
        return np.asarray(common.logits(model.backbone, hidden), np.float64)


def kl_and_greedy_agreement(base, quant):
    """KL(base ‖ quantized) a token, float64, and the share of positions whose arg-max token is the same."""
    p, r = (jax.nn.softmax(z) for z in (logits_of(base), logits_of(quant)))
    return float((p * (np.log(p) - np.log(r))).sum(-1).mean()), float((p.argmax(-1) == r.argmax(-1)).mean())


def weight(model, path):
    return next(np.asarray(v.value) for v in model.backbone.weights if v.path == path)


def test_int8_base_is_the_abs_max_rounding_of_the_base():
    mesh = common.make_mesh()
    base = common.load_model("tiny", mesh, "float32", lora_rank=4)
    quant = common.load_model("tiny", mesh, "float32", lora_rank=4, quantize="int8")
    # only the adapters train, in float32; the base kernels are int8 with float32 scales
    assert [v.path for v in quant.backbone.trainable_variables] == [
        v.path for v in base.backbone.trainable_variables
    ]
    assert all(v.dtype == "float32" and "lora_kernel" in v.path for v in quant.backbone.trainable_variables)
    q = "decoder_block_0/attention/query/"
    w = weight(base, q + "kernel")  # [heads 4, in 192, head_dim 48] ("btd,ndh->btnh"), float32 as Keras's
    assert (
        weight(quant, q + "kernel").dtype == np.int8 and weight(quant, q + "kernel_scale").dtype == np.float32
    )
    # per output channel (head, dim), over the 192 inputs: scale 127 / (max|w| + Keras's ε 1e-7), q = round(w · scale)
    scale = np.float32(127) / (np.abs(w).max(axis=1, keepdims=True) + np.float32(1e-7))  # [4, 1, 48]
    np.testing.assert_array_equal(weight(quant, q + "kernel"), np.round(w * scale))
    np.testing.assert_allclose(weight(quant, q + "kernel_scale").reshape(4, 48), scale[:, 0], rtol=1e-6)
    # what the model computes: the base's logits to int8 rounding (random weights: about 3e-5 nats)
    kl, same = kl_and_greedy_agreement(base, quant)
    assert 0 < kl < 2e-4, kl
    assert same >= 0.98


def test_int4_base_in_blocks_of_64():
    mesh = common.make_mesh()
    base = common.load_model("tiny", mesh, "float32", lora_rank=4)
    quant = common.load_model("tiny", mesh, "float32", lora_rank=4, quantize="int4")
    # two int4 values a byte; a scale and a zero point per 64 input rows (192 = 3 blocks) and output channel
    q = "decoder_block_0/ffw_gating/"
    assert weight(quant, q + "kernel").shape == (192, 512 // 2)  # [in 192, out 512]
    assert weight(quant, q + "kernel_scale").shape == (3, 512)
    kl, same = kl_and_greedy_agreement(base, quant)
    assert 2e-4 < kl < 0.05, kl  # coarser than int8's (about 7e-3 here), still the same model
    assert same >= 0.7


def test_quantized_sharded_step_equals_one_device():
    """data=4, model=2: the int8 kernels and their scales laid out as the weights they replace (Gemma's map),
    and two LoRA steps on them equal the one-device steps."""
    mesh = common.make_mesh("data=4,model=2")
    sharded = common.load_model("tiny", mesh, "float32", lora_rank=4, quantize="int8")
    single = common.load_model("tiny", single_device_mesh(), "float32", lora_rank=4, quantize="int8")
    specs = {v.path: v.value.sharding.spec for v in sharded.backbone.weights}
    assert specs["decoder_block_0/attention/query/kernel"] == jax.sharding.PartitionSpec(
        "model", "data", None
    )
    for a, b in zip(sharded.backbone.weights, single.backbone.weights):
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))  # the same base, quantized
    args = sft.Args(learning_rate=1e-2, warmup_steps=1, max_steps=10, lora_rank=4)
    loss_8, params_8 = run_steps(sharded, mesh, args)
    loss_1, params_1 = run_steps(single, single_device_mesh(), args)
    np.testing.assert_allclose(loss_8, loss_1, rtol=1e-5)
    for a, b in zip(params_8, params_1):
        np.testing.assert_allclose(a, b, atol=2e-4)
    assert loss_8[1] < loss_8[0]


def test_saved_model_is_the_adapters_merged_into_the_unquantized_base(tmp_path):
    """model/ of a --quantize run: W + (α / r)·A·B on the base as loaded, float32, where Keras's own save would
    merge into the int8 kernel and round the update away."""
    mesh = common.make_mesh()
    model = common.load_model("tiny", mesh, "float32", lora_rank=4, lora_alpha=8, quantize="int8")
    rng = np.random.default_rng(1)
    params = [
        jnp.asarray(rng.normal(0, 0.01, v.shape), jnp.float32) for v in model.backbone.trainable_variables
    ]
    common.save_model(model, params, str(tmp_path / "model"))
    saved = keras_hub.models.CausalLM.from_preset(str(tmp_path / "model"))
    assert not [v.path for v in saved.backbone.weights if v.dtype != "float32"]
    q = "decoder_block_1/attention/query/"
    names = [v.path for v in model.backbone.trainable_variables]
    a, b = (np.asarray(params[names.index(q + n)], np.float64) for n in ("lora_kernel_a", "lora_kernel_b"))
    w = weight(common.load_model("tiny", mesh, "float32"), q + "kernel")
    got = weight(saved, q + "kernel")
    np.testing.assert_allclose(got, w + 8 / 4 * np.einsum("ndr,rh->ndh", a, b), rtol=1e-5, atol=1e-7)


def test_quantize_needs_lora(tmp_path):
    message = usage_error(sft, "--quantize", "int8", "--max-steps", "1", "--output-dir", str(tmp_path / "o"))
    assert message == "--quantize int8 quantizes the frozen base of a LoRA run: add --lora-rank"
    assert not (tmp_path / "o").exists()


def test_adapter_files_are_the_merged_update_in_pefts_form(tmp_path):
    """model/'s adapter_model.safetensors and adapter_config.json, as PEFT reads them (W + (lora_alpha / r)·B·A
    per module, rank_pattern / alpha_pattern over r / lora_alpha), against the --export-hf checkpoints of the
    merged model and of its base, which KerasHub's own exporter lays out in transformers' names: on all seven
    projections of every block, the update is the same."""
    from safetensors.numpy import load_file

    mesh = common.make_mesh()
    lora_model = common.load_model(
        "tiny", mesh, "float32", lora_rank=2, lora_alpha=4, lora_target_modules=("all-linear",)
    )
    base = common.load_model("tiny", mesh, "float32")
    rng = np.random.default_rng(2)
    params = [
        jnp.asarray(rng.normal(0, 0.05, v.shape), jnp.float32)
        for v in lora_model.backbone.trainable_variables
    ]
    common.save_model(lora_model, params, str(tmp_path / "model"))
    common.save_model(base, common.split_variables(base.backbone)[0], str(tmp_path / "base"))
    assert not (tmp_path / "base" / "adapter_config.json").exists()  # full fine-tuning: no adapters
    for name in ("model", "base"):
        interop.export_hf(common.host_model(str(tmp_path / name)), str(tmp_path / f"{name}_hf"))
    merged, original = (load_file(str(tmp_path / f"{n}_hf" / "model.safetensors")) for n in ("model", "base"))
    adapter = load_file(str(tmp_path / "model" / "adapter_model.safetensors"))
    with open(tmp_path / "model" / "adapter_config.json") as f:
        config = json.load(f)
    # tiny: 4 query heads, 1 key/value head; r 2, α 4. The query's A is per head in Keras: rank 4 × 2 in PEFT
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 2, 4)
    assert config["target_modules"] == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    assert (config["rank_pattern"], config["alpha_pattern"]) == ({"q_proj": 8}, {"q_proj": 16})
    assert len(adapter) == 4 * 7 * 2
    for key in (k for k in adapter if k.endswith(".lora_A.weight")):
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        short = module.rsplit(".", 1)[1]
        r, alpha = config["rank_pattern"].get(short, 2), config["alpha_pattern"].get(short, 4)
        a, b = adapter[key].astype(np.float64), adapter[key.replace("lora_A", "lora_B")].astype(np.float64)
        assert a.shape[0] == b.shape[1] == r, key
        update = merged[module + ".weight"].astype(np.float64) - original[module + ".weight"]
        assert np.abs(update).max() > 1e-3, key  # the merged model moved
        np.testing.assert_allclose(update, alpha / r * b @ a, atol=2e-6, err_msg=key)


def test_a_peft_adapter_is_where_lora_starts(tmp_path):
    """--lora-adapter tests/peft_tiny/: an adapter PEFT 0.21.2 wrote for tiny's --export-hf checkpoint (get_peft_model
    with random A and B: r 2, α 4, on q/k/v/o_proj and down_proj). Loaded as Keras's LoRA, tiny's logits are the
    ones transformers + PEFT computed (recorded beside it); written back by save_adapter, every module's update
    is the file's; and sft.py trains on from it."""
    from safetensors.numpy import load_file

    fixture = os.path.join(ROOT, "tests", "peft_tiny")
    model = common.load_model("tiny", common.make_mesh(), "float32", lora_rank=1, lora_adapter=fixture)
    # PEFT's rank 2 on the query (4 heads) is Keras's 8: one A block per head; the rest as they are
    ranks = {
        v.path.split("/")[-2]: v.shape[-1]
        for v in model.backbone.trainable_variables
        if "lora_kernel_a" in v.path
    }
    assert ranks == {"query": 8, "key": 2, "value": 2, "attention_output": 2, "ffw_linear": 2}
    with open(os.path.join(fixture, "expected_logits.json")) as f:
        expected = json.load(f)
    ids = np.asarray([expected["token_ids"]], np.int32)
    logits = logits_of(model, ids)[0]
    np.testing.assert_allclose(logits, expected["logits"], atol=1e-4)
    plain = logits_of(common.load_model("tiny", common.make_mesh(), "float32"), ids)[0]
    assert np.abs(logits - plain).max() > 0.1  # the adapter moves them
    lora.save_adapter(model.backbone, str(tmp_path))
    written, original = (
        load_file(str(tmp_path / "adapter_model.safetensors")),
        load_file(os.path.join(fixture, "adapter_model.safetensors")),
    )
    with open(tmp_path / "adapter_config.json") as f:
        config = json.load(f)
    assert sorted(written) == sorted(original)
    for key in (k for k in original if "lora_A" in k):
        short = key.split(".")[-3]
        r, alpha = (
            config["rank_pattern"].get(short, config["r"]),
            config["alpha_pattern"].get(short, config["lora_alpha"]),
        )
        update = alpha / r * written[key.replace("lora_A", "lora_B")].astype(np.float64) @ written[key]
        np.testing.assert_allclose(
            update,
            4 / 2 * original[key.replace("lora_A", "lora_B")].astype(np.float64) @ original[key],
            atol=1e-6,
            err_msg=key,
        )
    out = tmp_path / "run"
    done = run_script(
        "sft.py",
        "--lora-rank",
        "1",
        "--lora-adapter",
        fixture,
        "--max-steps",
        "2",
        "--learning-rate",
        "1e-3",
        "--output-dir",
        str(out),
    )
    assert "done: 2 steps" in done.stdout
    with open(out / "model" / "adapter_config.json") as f:
        # trained on, each head's A [D, 8] is its own: PEFT's form of the query's update is 4 heads × 8
        assert json.load(f)["rank_pattern"] == {"q_proj": 32}
    assert usage_error(sft, "--lora-adapter", fixture, "--output-dir", str(tmp_path / "o")) == (
        f"--lora-adapter {fixture} continues a LoRA run: add --lora-rank (its ranks are the adapter's)"
    )
