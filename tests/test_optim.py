"""The optimisation a TRL user sets with flags: each --lr-scheduler-type at hand-written steps (transformers'
lr_lambda formulas), --warmup-ratio's rounding, 20 DPO steps of dpo.py's own train_step against clipped AdamW
written out in float64 NumPy, and LoRA's α/r scale, target layers and merge on save."""

import math
import os
from functools import partial

import numpy as np
import pytest

import common  # first: KERAS_BACKEND=jax
import dpo
import lora
import jax
import jax.numpy as jnp
import keras
import keras_hub
import optax
import plumbing


# ---------------------------------------------------------------------------
# Schedules: common.lr_schedule(kind, peak, total, warmup) at optimizer update `count` (0 = the first)
# ---------------------------------------------------------------------------
def rates(kind, total=10, warmup_steps=2, **kw):
    schedule, warmup = common.lr_schedule(kind, 1.0, total, warmup_steps, **kw)
    return {t: float(schedule(t)) for t in range(total + 1)}, warmup


def test_linear_warmup_then_linear_to_zero():
    r, warmup = rates("linear")  # TRL's default (transformers' get_linear_schedule_with_warmup)
    assert warmup == 2
    expected = {0: 0.0, 1: 1 / 2, 2: 8 / 8, 3: 7 / 8, 6: 4 / 8, 9: 1 / 8}  # (10 - t) / (10 - 2)
    assert {t: r[t] for t in expected} == pytest.approx(expected, abs=1e-7)
    assert r[10] == r[9]  # past the last update (t = 9), as --resume extends a run: its rate held, not 0


def test_past_the_last_update_the_rate_is_held_never_raised():
    """An extended run (--resume --max-steps 80 on a finished 60-step one, plumbing.Run.schedule_steps 60)
    goes on at the rate of update 59; spread over 80 instead (transformers' re-built scheduler,
    --resume-schedule stretch), update 69 would be at 11/80 of the peak, up from 1/60."""
    kept, _ = common.lr_schedule("linear", 1.5e-4, 60)
    assert [float(kept(t)) for t in (59, 60, 69, 79)] == pytest.approx([1.5e-4 * 1 / 60] * 4, rel=1e-6)
    stretched, _ = common.lr_schedule("linear", 1.5e-4, 80)
    assert float(stretched(69)) == pytest.approx(1.5e-4 * 11 / 80) and float(stretched(69)) > float(kept(59))


def test_cosine_to_zero():
    r, _ = rates("cosine")
    half_cos = lambda progress: 0.5 * (1 + math.cos(math.pi * progress))  # progress = (t - 2) / 8
    expected = {
        0: 0.0,
        1: 1 / 2,
        2: 1.0,
        4: 0.5 + math.sqrt(2) / 4,
        6: 0.5,
        9: half_cos(7 / 8),
        10: half_cos(7 / 8),
    }
    assert {t: r[t] for t in expected} == pytest.approx(expected, abs=1e-7)


def test_cosine_with_min_lr_floors_at_the_rate_and_is_the_former_schedule():
    r, _ = rates("cosine_with_min_lr", min_lr_rate=0.1)
    expected = {
        0: 0.0,
        1: 1 / 2,
        2: 1.0,
        6: 0.5 * 0.9 + 0.1,
        9: 0.5 * (1 + math.cos(math.pi * 7 / 8)) * 0.9 + 0.1,
    }
    assert {t: r[t] for t in expected} == pytest.approx(expected, abs=1e-7)
    # min_lr_rate 0.1 is the warmup + cosine-to-10% every offline script ran before the flag existed
    for total, warmup in ((40, 5), (150, 20), (10, 0), (3, 5)):
        new, _ = common.lr_schedule("cosine_with_min_lr", 5e-5, total, warmup, min_lr_rate=0.1)
        old = optax.warmup_cosine_decay_schedule(0.0, 5e-5, warmup, max(total, warmup + 1), end_value=5e-6)
        np.testing.assert_allclose([new(t) for t in range(total)], [old(t) for t in range(total)], rtol=1e-6)


def test_constant_has_no_warmup_and_constant_with_warmup_has():
    r, warmup = rates("constant")  # transformers' get_scheduler ignores the warmup for `constant`
    assert warmup == 0 and set(r.values()) == {1.0}
    r, warmup = rates("constant_with_warmup")
    assert warmup == 2 and [r[t] for t in range(5)] == pytest.approx([0.0, 1 / 2, 1.0, 1.0, 1.0])


def test_warmup_ratio_rounds_up_and_warmup_steps_win():
    """TrainingArguments.get_warmup_steps: --warmup-steps when > 0, else ceil(ratio × total)."""
    assert common.lr_schedule("linear", 1.0, 20, 0, warmup_ratio=0.1)[1] == 2  # 0.1 × 20 = 2.0 exactly
    assert common.lr_schedule("linear", 1.0, 20, 0, warmup_ratio=0.11)[1] == 3  # ceil(2.2)
    assert common.lr_schedule("linear", 1.0, 20, 5, warmup_ratio=0.5)[1] == 5


def test_schedule_flags_are_checked_and_trls_extra_names_answered(tmp_path):
    import plumbing

    with pytest.raises(plumbing.UsageError, match="polynomial"):  # not offered: tyro lists the choices
        plumbing.cli(dpo.Args, ["--lr-scheduler-type", "polynomial"])
    with pytest.raises(plumbing.UsageError, match="--lr-scheduler-kwargs is --min-lr-rate"):
        plumbing.cli(dpo.Args, ["--lr-scheduler-kwargs", '{"min_lr_rate": 0.1}'])
    with pytest.raises(plumbing.UsageError, match="--lora-dropout is absent"):
        plumbing.cli(dpo.Args, ["--lora-dropout", "0.05"])
    with pytest.raises(plumbing.UsageError, match=r"--warmup-ratio 1.5, --min-lr-rate 0.1: each must be in"):
        plumbing.Run("dpo", dpo.Args(warmup_ratio=1.5, output_dir=str(tmp_path / "run")))


# ---------------------------------------------------------------------------
# 20 DPO steps: plumbing.make_optimizer + dpo.py's train_step against clipped AdamW in float64 NumPy
# ---------------------------------------------------------------------------
STEPS, LR, WD = 20, 3e-3, 0.1


def numpy_trajectory(grad_fn, params0, batches, rate, clip=True):
    """torch.optim.AdamW as TRL's trainers run it (β1 0.9, β2 0.999, ε 1e-8, decoupled weight decay, here
    on matrices only as the scripts apply it) after torch's clip_grad_norm_(1.0), at rate(t) for update t;
    the gradient of each step from jax at the float32 copy of these float64 weights. -> (losses, params)."""
    p = [x.astype(np.float64) for x in params0]
    m, v, losses = [np.zeros_like(x) for x in p], [np.zeros_like(x) for x in p], []
    for t in range(STEPS):
        loss, g = grad_fn([x.astype(np.float32) for x in p], batches[t])
        g, lr = [np.asarray(x, np.float64) for x in g], rate(t)
        losses.append(float(loss))
        norm = math.sqrt(sum(float((x * x).sum()) for x in g))
        coef = min(1.0, 1.0 / (norm + 1e-6)) if clip else 1.0
        for i, gi in enumerate(g):
            m[i] = 0.9 * m[i] + 0.1 * coef * gi
            v[i] = 0.999 * v[i] + 0.001 * (coef * gi) ** 2
            m_hat, v_hat = m[i] / (1 - 0.9 ** (t + 1)), v[i] / (1 - 0.999 ** (t + 1))
            decay = WD * p[i] if p[i].ndim >= 2 else 0.0  # no decay on norms (1-D)
            p[i] = p[i] - lr * (m_hat / (np.sqrt(v_hat) + 1e-8) + decay)
    return np.array(losses), p


def test_dpo_trajectory_follows_clipped_adamw_at_trls_schedule():
    """Same data order (dpo.get_batch), same optimizer and schedule: the script's per-step losses and final
    weights follow a trajectory written out here. It separates what it checks: the former schedule (cosine to
    10%) and the same schedule without the gradient clip each end far outside the tolerance."""
    keras.utils.set_random_seed(0)
    tokenizer = keras_hub.models.GemmaTokenizer(proto=common.TINY_TOKENIZER)
    backbone = keras_hub.models.GemmaBackbone(  # a one-block Gemma: ~15k weights, seconds to compile
        vocabulary_size=tokenizer.vocabulary_size(),
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=32,
        intermediate_dim=64,
        head_dim=16,
        dtype="float32",
    )
    path = os.path.join(common.HERE, "data", "prefs_train.jsonl")
    pairs, _ = dpo.tokenize_dataset(
        common.read_dataset(path, "preference", common.chat_template("tiny"))[:64], tokenizer, 512, path
    )
    data = dpo.pad_examples(pairs, common.bucket_length(max(len(s[0]) for x in pairs for s in x), 512))
    # β 1: gradient norms 1.7-4.5, so the clip at 1.0 acts at every step (at β 0.1 they stay below 0.5)
    args = dpo.Args(
        learning_rate=LR, batch_size=8, max_steps=STEPS, warmup_ratio=0.1, weight_decay=WD, beta=1.0
    )
    batches = [
        dpo.get_batch(data, dpo.pair_lengths(data), t, args)[0] for t in range(STEPS)
    ]  # [1, 8, T] each

    optimizer, schedule, warmup = plumbing.make_optimizer(args, STEPS)
    assert warmup == 2  # ceil(0.1 × 20)
    params, frozen = common.split_variables(backbone)
    params0, ref_params = [np.asarray(p) for p in params], [jnp.copy(p) for p in params]
    step_fn = jax.jit(partial(dpo.train_step, backbone, optimizer, args))
    state, script_losses = (params, optimizer.init(params)), []
    for t in range(STEPS):
        state, metrics = step_fn(state, frozen, batches[t], ref_params)
        script_losses.append(float(metrics["train/loss"]))  # the loss before update t

    def loss(p, batch):  # DPO (Eq. 1) of the batch's pairs against the initial weights, β = 1 (a dense model:
        b = jax.tree.map(lambda x: x[0], batch)  # no router loss)
        policy = dpo.concatenated_forward(backbone, p, frozen, b)[0]
        ref = dpo.concatenated_forward(backbone, ref_params, frozen, b)[0]
        sides = ("chosen_logps", "rejected_logps")
        return dpo.dpo_loss(*(policy[k] for k in sides), *(ref[k] for k in sides), beta=1.0)[0]

    grad_fn = jax.jit(jax.value_and_grad(loss))
    linear = lambda t: (
        LR * t / 2 if t < 2 else LR * (STEPS - t) / (STEPS - 2)
    )  # TRL's default, 2 warmup steps
    losses, weights = numpy_trajectory(grad_fn, params0, batches, linear)
    # float32 (the script) against float64 (here): 3e-6 in the loss, 3e-7 in a weight, measured
    np.testing.assert_allclose(script_losses, losses, rtol=0, atol=2e-5)
    for got, want in zip(state[0], weights):
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=3e-6)
    assert losses[-1] < losses[0] - 0.2  # it trained: 0.69 -> 0.32 measured

    cosine_to_10 = lambda t: (
        linear(t) if t < 2 else LR * (0.1 + 0.45 * (1 + math.cos(math.pi * (t - 2) / 18)))
    )
    for rate, clip in ((cosine_to_10, True), (linear, False)):
        other, _ = numpy_trajectory(grad_fn, params0, batches, rate, clip)
        assert np.max(np.abs(np.array(script_losses) - other)) > 1e-3  # 0.021 and 0.046 measured


def test_first_moment_in_bfloat16_rounds_the_stored_moment_only():
    """--adam-mu-dtype bfloat16 (optax's mu_dtype): the first moment is kept in bf16 between updates, each
    update computed in float32 from it. By hand, at a constant gradient 0.3, lr 1, β1 0.9, β2 0.999, no clip
    (|g| < 1) and no decay: update 1 is -0.3/0.3 = -1 in both; the stored m1 = bf16(0.03) = 0.030029296875
    (0.03 = 1.92·2^-6, and 1.92 to 7 fraction bits is 1.921875). Update 2 takes β1·m1 in bf16 too (a Python
    float times a bf16 array): 0.0270263671875 = 1.7296875·2^-6 rounds to 1.7265625·2^-6 = 0.0269775390625,
    so m2 = 0.0269775390625 + 0.03 and update 2 = -(m2 / 0.19) / 0.3 = -0.9996059 (v̂2 = 0.09), where
    float32's m2 = 0.057 gives -1. The default keeps float32 (plumbing.make_optimizer: every script's)."""
    import sft

    params, g = [jnp.ones((1, 1))], [jnp.full((1, 1), 0.3)]
    for mu_dtype in ("float32", "bfloat16"):
        state = plumbing.make_optimizer(sft.Args(adam_mu_dtype=mu_dtype), 10)[0].init(params)
        adam = [s for s in jax.tree.leaves(state, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu")]
        assert [(m.dtype, v.dtype) for m, v in ((a.mu[0], a.nu[0]) for a in adam)] == [
            (jnp.dtype(mu_dtype), jnp.float32)
        ]
    m2 = 0.0269775390625 + 0.1 * 0.3
    for mu_dtype, second in (("float32", -1.0), ("bfloat16", -(m2 / 0.19) / 0.3)):
        args = sft.Args(learning_rate=1.0, lr_scheduler_type="constant", adam_mu_dtype=mu_dtype)
        optimizer = plumbing.make_optimizer(args, 10)[0]
        state, updates = optimizer.init(params), []
        for _ in range(2):
            u, state = optimizer.update(g, state, params)
            updates.append(float(u[0][0, 0]))
        # float32's own rounding (of 0.999, 1 - 0.999^t, the square root) is 1e-5 here, the bf16 moment's 3.9e-4
        assert updates == pytest.approx([-1.0, second], rel=3e-5), mu_dtype
    assert -(m2 / 0.19) / 0.3 == pytest.approx(-0.9996059, rel=1e-7)  # the bf16 moment's difference: 3.9e-4


# ---------------------------------------------------------------------------
# LoRA: W + (α/r)·A·B on the target layers, merged so on save
# ---------------------------------------------------------------------------
SMALL = dict(num_layers=1, num_query_heads=4, num_key_value_heads=2, hidden_dim=32, intermediate_dim=64)


def linear_layers(backbone):
    """The Dense / EinsumDense layers, in the backbone's own order (the same in a reloaded copy)."""
    return [
        layer
        for layer in backbone._flatten_layers(include_self=False)
        if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense))
    ]


@pytest.mark.parametrize("family", ["gemma", "llama3"])  # MLP of EinsumDense (Gemma) or Dense (Llama 3, …)
def test_all_linear_adapts_attention_and_mlp_at_alpha_over_rank(family, tmp_path):
    """--lora-target-modules all-linear: every Dense / EinsumDense, the MLP's too, and only their A and B
    train; the effective kernel is W + (α/r)·A·B, and what is saved is that kernel, merged."""
    keras.utils.set_random_seed(0)
    tokenizer = keras_hub.models.GemmaTokenizer(proto=common.TINY_TOKENIZER)
    if family == "gemma":
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=tokenizer.vocabulary_size(), head_dim=8, dtype="float32", **SMALL
        )
        mlp = ["ffw_gating", "ffw_gating_2", "ffw_linear"]
    else:
        backbone = keras_hub.models.Llama3Backbone(
            vocabulary_size=tokenizer.vocabulary_size(), dtype="float32", **SMALL
        )
        mlp = ["feedforward_gate_dense", "feedforward_intermediate_dense", "feedforward_output_dense"]
    layers = linear_layers(backbone)
    base = [np.asarray(layer.kernel) for layer in layers]
    rank, alpha = 4, 32
    lora.enable_lora(backbone, rank, alpha, ("all-linear",))
    assert sorted(layer.name for layer in layers if layer.lora_enabled) == sorted(
        ["query", "key", "value", "attention_output"] + mlp
    )
    trained = [v.path.rsplit("/", 1)[-1] for v in backbone.trainable_variables]
    assert trained == ["lora_kernel_a", "lora_kernel_b"] * 7  # 7 layers a block, nothing else

    rng = np.random.default_rng(0)
    for layer in layers:  # B starts at 0 (ΔW = 0): set it by hand
        layer.lora_kernel_b.assign(rng.normal(0, 0.1, layer.lora_kernel_b.shape).astype(np.float32))
    for layer, w in zip(layers, base):
        a, b = np.asarray(layer.lora_kernel_a), np.asarray(layer.lora_kernel_b)
        expected = w + alpha / rank * np.matmul(a, b)  # A [..., r] @ B [r, out]: the kernel's shape
        assert np.abs(expected - w).max() > 1e-2
        np.testing.assert_allclose(np.asarray(layer.kernel), expected, rtol=1e-5, atol=1e-6)  # the forward's
        store = {}
        layer.save_own_variables(store)  # what a saved preset holds: "0" is the kernel
        np.testing.assert_allclose(np.asarray(store["0"]), expected, rtol=1e-5, atol=1e-6)
    if family == "gemma":  # and through common.save_model, read back as a plain preset
        model = keras_hub.models.GemmaCausalLM(
            backbone, keras_hub.models.GemmaCausalLMPreprocessor(tokenizer)
        )
        common.save_model(model, common.split_variables(backbone)[0], str(tmp_path / "merged"))
        loaded = keras_hub.models.CausalLM.from_preset(str(tmp_path / "merged"))
        assert not any("lora" in v.path for v in loaded.backbone.weights)
        for layer, reloaded in zip(layers, linear_layers(loaded.backbone)):
            np.testing.assert_allclose(
                np.asarray(reloaded.kernel), np.asarray(layer.kernel), rtol=1e-6, atol=1e-7
            )


def test_default_targets_are_query_and_value_with_biases_frozen():
    """None: KerasHub's and PEFT's default (q_proj, v_proj); Qwen's query / value biases stay frozen
    (PEFT's bias="none"; KerasHub's own enable_lora trains them, so a LoRA-off reference would drift)."""
    backbone = keras_hub.models.QwenBackbone(vocabulary_size=64, dtype="float32", **SMALL)
    lora.enable_lora(backbone, 2)
    assert sorted(v.path for v in backbone.trainable_variables) == sorted(
        f"transformer_layer_0/self_attention/{n}/lora_kernel_{x}" for n in ("query", "value") for x in "ab"
    )
    with pytest.raises(
        common.UsageError,
        match="q_proj: not this model's; all-linear or its layers attention_output, feedforward_gate_dense",
    ):
        lora.enable_lora(keras_hub.models.QwenBackbone(vocabulary_size=64, **SMALL), 2, 16, ("q_proj",))


def test_first_update_doubles_with_alpha():
    """B starts at 0, so the first AdamW update moves B by the same −lr·m̂/(√v̂ + ε) whatever the
    gradient's scale, and A not at all (its gradient is 0): the weight change (α/r)·A·ΔB doubles with α.
    One dpo.py train_step each on a one-block Gemma, the same A (same seed), α 16 and 32 at rank 4."""
    tokenizer = keras_hub.models.GemmaTokenizer(proto=common.TINY_TOKENIZER)
    path = os.path.join(common.HERE, "data", "prefs_eval.jsonl")
    pairs, _ = dpo.tokenize_dataset(
        common.read_dataset(path, "preference", common.chat_template("tiny"))[:8], tokenizer, 512, path
    )
    data = dpo.pad_examples(pairs, common.bucket_length(max(len(s[0]) for x in pairs for s in x), 512))
    args = dpo.Args(learning_rate=1e-3, batch_size=8, max_steps=10, beta=1.0)  # β 1: gradients ≫ Adam's ε
    batch, optimizer = (
        dpo.get_batch(data, dpo.pair_lengths(data), 0, args)[0],
        plumbing.make_optimizer(args, 10)[0],
    )
    deltas = []
    for alpha in (16, 32):
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=tokenizer.vocabulary_size(), head_dim=8, dtype="float32", **SMALL
        )
        lora.enable_lora(backbone, 4, alpha, ("all-linear",))
        layers = linear_layers(backbone)
        before = [np.asarray(layer.kernel) for layer in layers]
        params, frozen = common.split_variables(backbone)
        (params, _), _ = jax.jit(partial(dpo.train_step, backbone, optimizer, args))(
            (params, optimizer.init(params)), frozen, batch, dpo.lora_off(backbone, params)
        )
        for var, value in zip(backbone.trainable_variables, params):
            var.assign(value)
        deltas.append([np.asarray(layer.kernel) - w for layer, w in zip(layers, before)])
    assert len(deltas[0]) == 7  # q, k, v, o, gate, up, down
    for small, large in zip(*deltas):  # 5e-6 apart measured (float32, and Adam's ε on the smallest gradients)
        assert np.abs(small).max() > 1e-5
        assert np.linalg.norm(large - 2 * small) < 1e-4 * np.linalg.norm(2 * small)


def test_lora_flags_reach_the_model():
    """--lora-rank, --lora-alpha, --lora-target-modules (comma-separated KerasHub names) through the CLI's
    Args to common.load_model: the named layers of every block, at α/r; TRL's defaults otherwise."""
    import plumbing

    assert (dpo.Args().lora_alpha, dpo.Args().lora_target_modules) == (32, None)  # TRL ModelConfig's
    args = plumbing.cli(
        dpo.Args, ["--lora-rank", "4", "--lora-alpha", "8", "--lora-target-modules", "query,ffw_linear"]
    )
    model = common.load_model("tiny", common.make_mesh(), "float32", **args.lora)
    adapted = [layer for layer in linear_layers(model.backbone) if layer.lora_enabled]
    assert sorted(layer.name for layer in adapted) == ["ffw_linear"] * 4 + ["query"] * 4  # 4 blocks
    assert {(layer.lora_rank, layer.lora_alpha) for layer in adapted} == {(4, 8)}


def test_all_linear_on_qwen3_moe_leaves_the_stacked_experts():
    """Qwen3-MoE's experts are one layer of stacked weights, not Dense layers: all-linear adapts attention
    and the router only (docs/trl.md, "Defaults": what PEFT would adapt there that Keras' LoRA cannot)."""
    backbone = keras_hub.models.Qwen3MoeBackbone(
        vocabulary_size=64,
        num_layers=1,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        head_dim=8,
        moe_intermediate_dim=16,
        num_experts=4,
        top_k=2,
    )
    lora.enable_lora(backbone, 2, 4, ("all-linear",))
    assert {v.path.split("/")[-2] for v in backbone.trainable_variables} == {
        "query",
        "key",
        "value",
        "attention_output",
        "sparse_feedforward_gate_dense",
    }
