"""--model resolution and the offline-reachable loading paths: a KerasHub preset
directory saved from `tiny`, and a Hugging Face-format Gemma directory written from
the same weights, must both give the original model's logits (the checkpoint that
`--export-hf` writes: tests/test_sft.py)."""

import json
import os

import numpy as np
import pytest

import common
import keras_hub


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    mesh = common.make_mesh()
    model = common.load_model("tiny", mesh, "float32", seed=1)
    ids = np.array([[2, 265, 283, 279, 286, 279, 293, 0]], np.int32)
    inputs = {"token_ids": ids, "padding_mask": ids != 0}
    return mesh, model, inputs, np.asarray(model(inputs)), tmp_path_factory.mktemp("models")


def test_aliases_and_unknown_name():
    assert common.resolve_model("gemma_2b") == "gemma_2b_en"
    assert common.resolve_model("gemma_2b_en") == "gemma_2b_en"  # any KerasHub preset
    assert common.resolve_model("hf://google/gemma-2b") == "hf://google/gemma-2b"
    assert common.resolve_model("kaggle://keras/gemma/keras/gemma_2b_en").startswith("kaggle://")
    with pytest.raises(common.UsageError, match="did you mean .*gemma_2b_it"):
        common.resolve_model("gemma_3b_typo")


def test_keras_hub_preset_round_trip(tiny):
    mesh, model, inputs, logits, tmp = tiny
    params, _ = common.split_variables(model.backbone)
    common.save_model(model, params, str(tmp / "preset"))
    loaded = keras_hub.models.CausalLM.from_preset(str(tmp / "preset"))
    np.testing.assert_allclose(np.asarray(loaded(inputs)), logits, rtol=1e-5, atol=1e-5)
    again = common.load_model(str(tmp / "preset"), mesh, "float32")  # and as --model DIR
    np.testing.assert_allclose(np.asarray(again(inputs)), logits, rtol=1e-5, atol=1e-5)


def test_hugging_face_directory(tiny):
    mesh, model, inputs, logits, tmp = tiny
    hf = str(tmp / "hf")
    model.export_to_transformers(hf)
    # keras-hub 0.32 writes no `architectures` into config.json, which its own loader needs.
    with open(os.path.join(hf, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["GemmaForCausalLM"]
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(config, f)
    assert sorted(os.listdir(hf)) == [
        "config.json",
        "model.safetensors",
        "tokenizer.model",
        "tokenizer_config.json",
    ]
    loaded = common.load_model(hf, mesh, "float32")
    assert type(loaded.backbone).__name__ == "GemmaBackbone"
    np.testing.assert_allclose(np.asarray(loaded(inputs)), logits, rtol=1e-5, atol=1e-5)
    tok = loaded.preprocessor.tokenizer
    assert list(tok.tokenize("Sort: 3 1 2")) == list(model.preprocessor.tokenizer.tokenize("Sort: 3 1 2"))


def test_lora_is_merged_on_save(tiny):
    mesh, _, inputs, _, tmp = tiny
    model = common.load_model("tiny", mesh, "float32", seed=1, lora_rank=2)
    params, frozen = common.split_variables(model.backbone)
    assert {v.path.rsplit("/", 1)[-1] for v in model.backbone.trainable_variables} == {
        "lora_kernel_a",
        "lora_kernel_b",
    }
    rng = np.random.default_rng(0)
    params = [p + rng.normal(0, 0.5, p.shape).astype(np.float32) for p in params]  # lora_b starts at 0
    common.save_model(model, params, str(tmp / "lora"))
    adapted = np.asarray(model(inputs))
    loaded = keras_hub.models.CausalLM.from_preset(str(tmp / "lora"))
    assert not any("lora" in v.path for v in loaded.backbone.weights)  # a plain preset
    np.testing.assert_allclose(np.asarray(loaded(inputs)), adapted, rtol=1e-4, atol=1e-4)


def test_a_model_folder_that_is_not_there_names_the_nearest_that_is(tmp_path, monkeypatch):
    """A path that names no folder is a missing folder, said as such with the nearest parent that exists (it
    listed ~50 aliases); TRL's `org/name` is also offered as a Hub id. Suggestions name each model once
    (`gemma2b` offered gemma4_2b twice: an alias and a preset of one name)."""
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(common.UsageError) as e:
        common.resolve_model("runs/my_sft/model")
    assert (
        str(e.value)
        == f"--model runs/my_sft/model: no such folder (the nearest that exists: {tmp_path / 'runs'})"
    )
    with pytest.raises(
        common.UsageError, match=r"\(the nearest that exists: .*\); as a Hugging Face Hub repo id"
    ):
        common.resolve_model("google/gemma-2b")
    with pytest.raises(common.UsageError) as e:
        common.resolve_model("gemma2b")
    close = str(e.value).split("did you mean ")[1].split("?")[0].split(", ")
    assert "gemma_2b" in close and len(close) == len(set(close)) == 3
