"""A mixture of experts trains with its router's load-balancing loss: a tiny random Qwen3-MoE (2 layers, 4
experts, top-2) with a byte-level BPE tokenizer built here, saved as a local KerasHub preset. KerasHub's MoE
layers add that loss with `add_loss`, which a stateless forward drops unless it collects it (common.forward).
Checked: the collected loss equals what KerasHub's own call adds and the layer's formula in float64; a
training step's loss includes it exactly once per forward (the policy's, not the reference's), and it moves
the router's gradient; under --remat too; the sampler's forward equals KerasHub's cached call; one step of
sft (chats) and dpo through their main() logs `aux_loss`."""

import math
import os
import subprocess
import sys
from functools import partial

import numpy as np
import pytest

from helpers import ROOT, byte_bpe, metrics, one_device_env

COEFFICIENT = 0.01  # the tiny model's router_aux_loss_coefficient (Qwen3-30B-A3B's: 0.001)
SIZE = dict(
    num_layers=2,
    hidden_dim=64,
    intermediate_dim=128,
    moe_intermediate_dim=32,
    num_experts=4,
    top_k=2,
    num_query_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    """A tiny random Qwen3-MoE CausalLM with Qwen's specials, saved as a local preset."""
    import common  # noqa: F401  (first: it keeps TensorFlow out of the process)
    import keras
    import keras_hub.models as m

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab, merges = byte_bpe(specials)
    keras.utils.set_random_seed(0)
    tokenizer = m.Qwen3MoeTokenizer(vocabulary=vocab, merges=merges, unsplittable_tokens=specials)
    backbone = m.Qwen3MoeBackbone(vocabulary_size=len(vocab), router_aux_loss_coefficient=COEFFICIENT, **SIZE)
    path = str(tmp_path_factory.mktemp("moe") / "qwen3_moe")
    m.Qwen3MoeCausalLM(backbone, m.Qwen3MoeCausalLMPreprocessor(tokenizer)).save_to_preset(path)
    return path


@pytest.fixture(scope="module")
def moe(preset):
    """(model, params, frozen, a right-padded batch {token_ids, padding_mask} [4, 12]) on one device: eager
    calls on weights spread over 8 simulated devices are several times slower, and nothing is sharded here."""
    import common
    import jax

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    model = common.load_model(preset, mesh, "float32")
    params, frozen = common.split_variables(model.backbone)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, model.backbone.vocabulary_size, (4, 12)).astype(np.int32)
    mask = np.arange(12)[None] < np.array([[12], [9], [5], [12]])  # rows 1 and 2 right-padded
    return model, params, frozen, {"token_ids": np.where(mask, ids, 0), "padding_mask": mask}


def set_coefficient(backbone, value, monkeypatch):
    """The router_aux_loss_coefficient each MoE layer multiplies its loss by (read when a step is traced)."""
    for layer in backbone.transformer_layers:
        monkeypatch.setattr(layer.mlp, "router_aux_loss_coefficient", value)


def load_balancing_loss(router_logits, attention_mask, top_k):
    """KerasHub's Qwen3-MoE per-layer loss (qwen3_moe_decoder.compute_load_balancing_loss), in float64:
    E · Σ_e f_e · P_e, where P_e is the mean router probability of expert e and f_e the share of top-k slots
    routed to it (averaged over the k slots), both over the tokens whose attention-mask row has any key:
    right padding counts (it attends to the tokens before it), left padding would not."""
    z = router_logits - router_logits.max(-1, keepdims=True)
    probs = np.exp(z) / np.exp(z).sum(-1, keepdims=True)  # [N, E]
    e = probs.shape[-1]
    chosen = np.eye(e)[np.argsort(-probs, -1)[:, :top_k]]  # [N, k, E]: one-hot of each token's top k
    counted = attention_mask.any(-1).reshape(-1).astype(np.float64)  # [N]
    f = (chosen * counted[:, None, None]).sum(0).mean(0) / counted.sum()  # [E]
    p = (probs * counted[:, None]).sum(0) / counted.sum()  # [E]
    return e * np.sum(f * p)


def test_collected_aux_loss_is_keras_hubs(moe, monkeypatch):
    """common.forward's aux_loss (jitted, stateless) == the losses KerasHub's own stateful call in training
    mode adds to `backbone.losses` == Σ over MoE layers of coefficient × the layer's formula, re-derived in
    float64 from the router logits that call produced; and its hidden states are the plain call's."""
    import common
    import jax

    model, params, frozen, batch = moe
    backbone = model.backbone
    captured = []  # (router logits [B·T, E], self-attention mask [B, T, T]) per MoE layer
    for layer in backbone.transformer_layers:

        def spy(x, attention_mask=None, training=None, _call=layer.mlp.call):
            out, router_logits = _call(x, attention_mask=attention_mask, training=training)
            captured.append((np.asarray(router_logits, np.float64), np.asarray(attention_mask)))
            return out, router_logits

        monkeypatch.setattr(layer.mlp, "call", spy)
    hidden = backbone(batch, training=True)  # eager, stateful: the layers' add_loss lands in backbone.losses
    theirs = [float(x) for x in backbone.losses]
    assert len(theirs) == len(captured) == 2  # one loss per MoE layer
    formula = [COEFFICIENT * load_balancing_loss(logits, mask, SIZE["top_k"]) for logits, mask in captured]
    np.testing.assert_allclose(theirs, formula, rtol=1e-5)
    monkeypatch.undo()  # the plain layers again, traced below
    ours_hidden, ours = jax.jit(partial(common.forward, backbone))(params, frozen, *batch.values())
    np.testing.assert_allclose(float(ours), sum(theirs), rtol=1e-5)
    assert float(ours) > 0  # the test can fail
    np.testing.assert_allclose(ours_hidden, hidden, atol=1e-5)


def sft_step(backbone, batch):
    """sft.train_step on one micro-batch with SGD at lr 1: -> (metrics, gradient per trainable variable)."""
    import common
    import jax
    import optax
    import sft

    params, frozen = common.split_variables(backbone)
    optimizer = optax.sgd(1.0)  # new = old - gradient
    step = jax.jit(partial(sft.train_step, backbone, optimizer, sft.Args()))  # traced afresh: the coefficient
    (new, _), m = step((params, optimizer.init(params)), frozen, {k: v[None] for k, v in batch.items()})
    return m, [np.asarray(p) - np.asarray(n) for p, n in zip(params, new)]


def test_train_step_adds_aux_loss_and_moves_the_router(moe, monkeypatch):
    """sft.train_step at coefficient c and at 0 on a fixed batch: train/loss differs by exactly the losses
    KerasHub's own call adds (c × Σ layers), logged as aux_loss; the router's gradient is non-zero without
    it (the LM loss reaches the router through the top-k weights) and moves by exactly the aux loss's own
    gradient with it. With activation checkpointing on each block (--remat on), a block's losses leave
    jax.checkpoint as its outputs: the same step."""
    import common
    import jax
    import plumbing

    model, params, frozen, batch = moe
    backbone = model.backbone
    inputs, batch = batch, {**batch, "loss_mask": batch["padding_mask"]}  # sft's batch: a loss on every token
    router = [
        i for i, v in enumerate(backbone.trainable_variables) if "sparse_feedforward_gate_dense" in v.path
    ]
    assert len(router) == 2
    c = 0.5  # large, so the aux term stands well above float32 noise in the loss
    set_coefficient(backbone, c, monkeypatch)
    backbone(inputs, training=True)  # KerasHub's own stateful call adds the layers' losses to backbone.losses
    aux = sum(float(x) for x in backbone.losses)
    with_aux, grads = sft_step(backbone, batch)
    set_coefficient(backbone, 0.0, monkeypatch)
    without, grads0 = sft_step(backbone, batch)
    assert aux > 0 and float(with_aux["train/loss"]) - float(without["train/loss"]) == pytest.approx(
        aux, rel=1e-4
    )
    assert float(with_aux["aux_loss"]) == pytest.approx(aux, rel=1e-5) and float(without["aux_loss"]) == 0.0
    set_coefficient(backbone, c, monkeypatch)
    aux_grads = jax.jit(
        jax.grad(lambda p: common.forward(backbone, p, frozen, batch["token_ids"], batch["padding_mask"])[1])
    )(params)
    for i in router:
        assert np.abs(grads0[i]).max() > 1e-4  # non-zero without the aux term
        moved = grads[i] - grads0[i]
        assert np.abs(moved).max() > 1e-3  # the coefficient changes the router's gradient ...
        np.testing.assert_allclose(moved, aux_grads[i], atol=1e-5)  # ... by exactly the aux term's gradient
    plumbing.enable_remat(backbone, "full")
    try:
        remat, remat_grads = sft_step(backbone, batch)
    finally:
        backbone.remat_mode = "off"
    for k in ("train/loss", "aux_loss"):
        assert float(remat[k]) == pytest.approx(float(with_aux[k]), rel=1e-5), k
    for a, b in zip(grads, remat_grads):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_sampler_forward_matches_keras_hub(moe):
    """Qwen3-MoE is one of common.FAMILIES (ChatML; its decoder layer is called as Qwen 3's): prefill + one
    decode step of common.cached_forward == Qwen3MoeCausalLM.call_with_cache, and a left-padded prompt gives
    the same logits."""
    import common
    import jax
    import jax.numpy as jnp

    model = moe[0]
    backbone = model.backbone
    assert common.FAMILIES[type(backbone).__name__] == "chatml"
    ours_fn = jax.jit(partial(common.cached_forward, backbone))  # jitted: eager, this test took 16 s
    theirs_fn = jax.jit(model.call_with_cache)
    ids = moe[3]["token_ids"][:1]  # [1, 12]
    t, s, pad = ids.shape[1], ids.shape[1] + 1, 3
    cache = common.empty_cache(backbone, 1, s)
    ours, ours_cache = ours_fn(ids, jnp.ones((1, s), bool), cache, 0)
    stacked = jnp.stack([jnp.stack(c, 1) for c in cache], 1)  # its cache: [B, L, 2, S, K, H]
    theirs, _, theirs_cache = theirs_fn(ids, stacked, 0)
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
    nxt = np.array([[7]], np.int32)
    step, _ = ours_fn(nxt, jnp.ones((1, s), bool), ours_cache, t)
    np.testing.assert_allclose(step, theirs_fn(nxt, theirs_cache, t)[0], atol=1e-5)
    padded = np.concatenate([np.zeros((1, pad), np.int32), ids], 1)
    mask = np.concatenate([np.zeros((1, pad), bool), np.ones((1, t + 1), bool)], 1)
    left, _ = ours_fn(padded, mask, common.empty_cache(backbone, 1, s + pad), 0)
    np.testing.assert_allclose(left[:, pad:], ours, atol=1e-4)


def run_scripts(preset, out):
    """One step of sft (on chats: the ChatML template from common.FAMILIES) and of dpo from `preset`, each
    through its main(), in this process; outputs under `out`."""
    import dpo
    import sft

    run = dict(model=preset, max_steps=1, batch_size=4, seed=0, remat="off", max_length=32, eval_dataset=None)
    sft.main(
        sft.Args(
            **run,
            dataset=os.path.join(ROOT, "data", "sft_messages_train.jsonl"),
            output_dir=os.path.join(out, "sft"),
        )
    )
    dpo.main(dpo.Args(**run, output_dir=os.path.join(out, "dpo")))


def test_one_step_of_sft_and_dpo(preset, tmp_path):
    """run_scripts in one process on one device, with JAX's persistent compilation cache as a script's own
    start-up (plumbing.launch) has it: finite losses, `aux_loss` logged (> 0: the router's term is
    in the loss), a model/ that is a Qwen3-MoE preset again. dpo's first step has its reference at the
    policy's weights: every margin is 0, the DPO loss −log σ(0) = log 2, so train/loss = log 2 + aux_loss:
    the policy's forward (chosen + rejected in one) adds its aux loss once, the reference's none."""
    import common

    res = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {ROOT!r}); import plumbing; plumbing.compilation_cache(); "
            f"from test_moe import run_scripts; run_scripts({preset!r}, {str(tmp_path)!r})",
        ],
        cwd=os.path.dirname(os.path.abspath(__file__)),
        capture_output=True,
        text=True,
        timeout=900,
        env=one_device_env(),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    for name in ("sft", "dpo"):
        row = metrics(tmp_path / name)[-1]
        assert row["step"] == 1 and math.isfinite(row["train/loss"]), name
        assert 0 < row["aux_loss"] < row["train/loss"], name
        assert common.backbone_class(str(tmp_path / name / "model")).__name__ == "Qwen3MoeBackbone"
    row = metrics(tmp_path / "dpo")[-1]
    assert row["rewards/margins"] == 0 and row["train/loss"] == pytest.approx(
        math.log(2) + row["aux_loss"], rel=1e-6
    )


def test_quantize_refuses_the_experts():
    """--quantize: the experts' stacked weights are no Dense / EinsumDense layer, which is all Keras
    quantizes; the run stops in one line rather than train on a base that is mostly unquantized."""
    import common
    import keras_hub.models as m
    import lora

    backbone = m.Qwen3MoeBackbone(vocabulary_size=64, **SIZE)
    with pytest.raises(common.UsageError) as e:
        lora.quantize_base(backbone, "int8", None)
    assert str(e.value).startswith("--quantize int8: Qwen3MoeBackbone's ") and "without --quantize" in str(
        e.value
    )
