"""dpo.py, simpo.py, orpo.py: the losses against hand-worked numbers and float64 NumPy,
the log-prob helpers, the reference model three ways, data validation, and each script
through its CLI on `tiny` (outputs, first-batch metrics before any update, learning)."""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import common
import dpo
import orpo
import simpo
from dpo import dpo_loss
from orpo import orpo_loss
from simpo import simpo_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG2 = math.log(2)


def log_sigmoid64(x):
    return -np.logaddexp(0.0, -x)


def random_logps(seed, n=16):
    rng = np.random.default_rng(seed)
    return [rng.uniform(-30, -1, n) for _ in range(4)]


# ---------------------------------------------------------------------------
# DPO
# ---------------------------------------------------------------------------
def test_dpo_hand_worked():
    loss, m = dpo_loss(jnp.array([-5.0, -9.0]), jnp.array([-7.0, -2.0]), jnp.array([-5.0, -9.0]),
                       jnp.array([-7.0, -2.0]), beta=0.1)
    assert float(loss) == pytest.approx(LOG2, abs=1e-6)  # policy == reference: equal margins
    assert float(m["rewards/margins"]) == 0 and float(m["rewards/accuracies"]) == 0
    # h = (−1 − (−3)) − (−2 − (−2)) = 2, β = 0.5: loss = −log σ(1) = log(1 + e^−1)
    loss, m = dpo_loss(jnp.array([-1.0]), jnp.array([-3.0]), jnp.array([-2.0]), jnp.array([-2.0]), beta=0.5)
    assert float(loss) == pytest.approx(math.log(1 + math.exp(-1)), abs=1e-6)
    assert float(m["rewards/chosen"]) == pytest.approx(0.5) and float(m["rewards/rejected"]) == pytest.approx(-0.5)
    assert float(m["rewards/margins"]) == pytest.approx(1.0) and float(m["rewards/accuracies"]) == 1.0
    assert float(m["logps/chosen"]) == -1.0 and float(m["logps/rejected"]) == -3.0


def test_dpo_variants_hand_worked():
    same = [jnp.array([-4.0])] * 4  # h = 0
    assert float(dpo_loss(*same, beta=0.1, loss_type="ipo")[0]) == pytest.approx((0 - 1 / 0.2) ** 2)  # 25
    assert float(dpo_loss(*same, beta=0.1, loss_type="hinge")[0]) == pytest.approx(1.0)
    h20 = [jnp.array([-1.0]), jnp.array([-21.0]), jnp.array([-5.0]), jnp.array([-5.0])]  # h = 20
    assert float(dpo_loss(*h20, beta=0.1, loss_type="hinge")[0]) == 0.0  # relu(1 − 2)
    assert float(dpo_loss(*h20, beta=0.1, loss_type="ipo")[0]) == pytest.approx((20 - 5) ** 2, rel=1e-6)
    # cDPO with ε = 0.5 is symmetric: ½(softplus(−βh) + softplus(βh)), βh = 2
    x = 2.0
    expected = 0.5 * (math.log1p(math.exp(-x)) + math.log1p(math.exp(x)))
    assert float(dpo_loss(*h20, beta=0.1, label_smoothing=0.5)[0]) == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError):
        dpo_loss(*same, loss_type="kto")


@pytest.mark.parametrize("loss_type, eps", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0), ("hinge", 0.0)])
def test_dpo_float64_rederivation(loss_type, eps):
    c, r, rc, rr = random_logps(1)
    beta = 0.3
    h = (c - r) - (rc - rr)
    if loss_type == "sigmoid":
        want = np.mean(-(1 - eps) * log_sigmoid64(beta * h) - eps * log_sigmoid64(-beta * h))
    elif loss_type == "ipo":
        want = np.mean((h - 1 / (2 * beta)) ** 2)
    else:
        want = np.mean(np.maximum(0.0, 1 - beta * h))
    loss, m = dpo_loss(*map(jnp.asarray, (c, r, rc, rr)), beta, loss_type, eps)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(m["rewards/margins"]), np.mean(beta * h), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(m["rewards/accuracies"]), np.mean(beta * (c - rc) > beta * (r - rr)))


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_dpo_direction(loss_type):
    args = [jnp.array([-10.0, -12.0]), jnp.array([-11.0, -9.0]), jnp.array([-10.5, -11.0]), jnp.array([-10.0, -10.0])]
    g = jax.grad(lambda c, r: dpo_loss(c, r, *args[2:], beta=0.1, loss_type=loss_type)[0], argnums=(0, 1))(*args[:2])
    assert (g[0] < 0).all() and (g[1] > 0).all()  # raising chosen / lowering rejected lowers the loss


# ---------------------------------------------------------------------------
# SimPO
# ---------------------------------------------------------------------------
def test_simpo_hand_worked():
    same = jnp.array([-0.7, -1.3])
    assert float(simpo_loss(same, same, 0.0, beta=2.0, gamma=0.0)[0]) == pytest.approx(LOG2, abs=1e-6)
    # equal rewards with margin γ = 1: −log σ(−1) = log(1 + e)
    assert float(simpo_loss(same, same, 0.0, beta=2.0, gamma=1.0)[0]) == pytest.approx(math.log(1 + math.e))
    # β·Δ = 2·0.5 = γ: back at log 2; sft_weight adds 0.5·NLL = 0.5·3
    loss, m = simpo_loss(jnp.array([-1.0]), jnp.array([-1.5]), 3.0, beta=2.0, gamma=1.0, sft_weight=0.5)
    assert float(loss) == pytest.approx(LOG2 + 1.5, abs=1e-6)
    assert float(m["rewards/chosen"]) == -2.0 and float(m["rewards/rejected"]) == -3.0
    assert float(m["rewards/margins"]) == 1.0 and float(m["nll_loss"]) == 3.0


def test_simpo_float64_rederivation_and_direction():
    c, r, _, _ = random_logps(2)
    c, r = c / 10, r / 10  # per-token means
    beta, gamma, w, nll = 2.5, 0.7, 0.3, 1.9
    want = np.mean(-log_sigmoid64(beta * c - beta * r - gamma)) + w * nll
    loss, m = simpo_loss(jnp.asarray(c), jnp.asarray(r), nll, beta, gamma, w)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(m["rewards/accuracies"]), np.mean(c > r))
    g = jax.grad(lambda c, r: simpo_loss(c, r, 0.0, beta, gamma)[0], argnums=(0, 1))(jnp.asarray(c), jnp.asarray(r))
    assert (g[0] < 0).all() and (g[1] > 0).all()


# ---------------------------------------------------------------------------
# ORPO
# ---------------------------------------------------------------------------
def test_orpo_hand_worked():
    half = jnp.log(jnp.array([0.5, 0.5]))  # P = 0.5: odds 1 each, odds ratio 1, log σ(0) = −log 2
    loss, m = orpo_loss(half, half, 1.0, beta=0.1)
    assert float(loss) == pytest.approx(1.0 + 0.1 * LOG2, abs=1e-6)
    assert float(m["log_odds_chosen"]) == pytest.approx(0.0, abs=1e-6)
    assert float(m["log_odds_ratio"]) == pytest.approx(-LOG2, abs=1e-6)
    # P+ = 0.8, P− = 0.2: odds 4 and 1/4, log OR = log 16, −log σ(log 16) = log(17/16)
    loss, m = orpo_loss(jnp.log(jnp.array([0.8])), jnp.log(jnp.array([0.2])), 0.5, beta=1.0)
    assert float(loss) == pytest.approx(0.5 + math.log(17 / 16), rel=1e-5)
    assert float(m["log_odds_chosen"]) == pytest.approx(math.log(16), rel=1e-5)
    assert float(m["rewards/margins"]) == pytest.approx(math.log(4), rel=1e-5)  # β(log .8 − log .2)


def test_orpo_float64_rederivation_and_direction():
    c, r, _, _ = random_logps(3)
    c, r = c / 10, r / 10
    lam, nll = 0.25, 2.2
    log_odds = (c - np.log1p(-np.exp(c))) - (r - np.log1p(-np.exp(r)))
    want = nll - lam * np.mean(log_sigmoid64(log_odds))
    loss, m = orpo_loss(jnp.asarray(c), jnp.asarray(r), nll, lam)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(m["log_odds_chosen"]), np.mean(log_odds), rtol=1e-4)
    g = jax.grad(lambda c, r: orpo_loss(c, r, 0.0, lam)[0], argnums=(0, 1))(jnp.asarray(c), jnp.asarray(r))
    assert (g[0] < 0).all() and (g[1] > 0).all()


def test_orpo_numerically_safe_at_extremes():
    x = np.array([0.0, -1e-9, -1e-6, -1e-3, -0.69, -0.7, -5.0, -50.0, -1e4])
    np.testing.assert_allclose(np.asarray(orpo.log1mexp(jnp.asarray(x[2:]))), np.log1p(-np.exp(x[2:])), rtol=1e-5)
    assert np.isfinite(np.asarray(orpo.log1mexp(jnp.asarray(x[:2])))).all()  # P = 1 is capped, not −inf
    c, r = jnp.asarray(x), jnp.asarray(x[::-1].copy())
    loss, m = orpo_loss(c, r, 1.0, 0.1)
    g = jax.grad(lambda c, r: orpo_loss(c, r, 1.0, 0.1)[0], argnums=(0, 1))(c, r)
    assert np.isfinite(float(loss)) and all(np.isfinite(float(v)) for v in m.values())
    assert np.isfinite(np.asarray(g[0])).all() and np.isfinite(np.asarray(g[1])).all()


# ---------------------------------------------------------------------------
# Log-prob helpers, data, and the reference model (tiny, in process)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("module", [dpo, simpo, orpo])
def test_sequence_logps_shift_and_padding(module):
    logps = jnp.array([[-1.0, -2.0, -3.0, -4.0, 9.0, 9.0]])  # position t scores token t+1
    mask = jnp.array([[False, False, True, True, True, False, False]])  # BOS, prompt, 3 response, 2 pad
    assert float(module.sequence_logps(logps, mask)[0]) == -2.0 - 3.0 - 4.0
    assert float(module.sequence_logps(logps, mask, average=True)[0]) == pytest.approx(-3.0)
    padded = module.sequence_logps(jnp.pad(logps, ((0, 0), (0, 5)), constant_values=7.0), jnp.pad(mask, ((0, 0), (0, 5))))
    assert float(padded[0]) == -9.0


@pytest.fixture(scope="module")
def prefs():
    """The tiny model (LoRA rank 4: base weights = plain `tiny`, seed 0) and 8 tokenised eval pairs."""
    mesh = common.make_mesh()
    model = common.load_model("tiny", mesh, "float32", seed=0, lora_rank=4)
    template = dpo.chat_template(model.backbone)
    pairs, _ = dpo.tokenize_dataset(os.path.join(ROOT, "data", "prefs_eval.jsonl"),
                                    model.preprocessor.tokenizer, template, 512)
    return mesh, model, pairs[:8]


def test_padding_invariance_of_sequence_logps_through_the_model(prefs):
    mesh, model, pairs = prefs
    params, frozen = common.split_variables(model.backbone)
    fwd = jax.jit(lambda b: dpo.concatenated_forward(model.backbone, params, frozen, b))
    short = fwd(dpo.pad_examples(pairs, 32))
    long = fwd(dpo.pad_examples(pairs, 48))
    for a, b in zip(short, long):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(short[0]) < 0) and not np.allclose(short[0], short[1])


def test_reference_logps_agree_three_ways(prefs):
    """πref = the initial model, whether a frozen copy of the full weights, the LoRA-off
    base of a trained LoRA policy, or log-probs precomputed in one pass."""
    mesh, model, pairs = prefs
    data = dpo.pad_examples(pairs, 32)
    lora_params, frozen = common.split_variables(model.backbone)
    plain = common.load_model("tiny", mesh, "float32", seed=0)  # the same base weights, no LoRA
    full_params, full_frozen = common.split_variables(plain.backbone)
    ref_copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p))(full_params)
    copy = dpo.reference_logps(plain.backbone, ref_copy, full_frozen, data)
    # A "trained" LoRA policy (B factors non-zero) differs from the base; its LoRA-off reference does not.
    rng = np.random.default_rng(0)
    trained = [p + 0.5 * rng.standard_normal(p.shape).astype(np.float32) if v.path.endswith("lora_kernel_b") else p
               for v, p in zip(model.backbone.trainable_variables, lora_params)]
    policy = dpo.concatenated_forward(model.backbone, trained, frozen, data)
    lora = dpo.reference_logps(model.backbone, dpo.lora_off(model.backbone, trained), frozen, data)
    fwd = jax.jit(lambda p, b: dpo.concatenated_forward(plain.backbone, p, full_frozen, jax.tree.map(lambda x: x[0], b)))
    pre = dpo.per_example(lambda b: fwd(full_params, b), data, 8, mesh)
    batch = {**data, "ref_chosen_logps": pre[0], "ref_rejected_logps": pre[1]}
    precomputed = dpo.reference_logps(None, None, None, batch)
    for i in range(2):
        np.testing.assert_allclose(np.asarray(lora[i]), np.asarray(copy[i]), rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(np.asarray(precomputed[i]), np.asarray(copy[i]), rtol=1e-5, atol=1e-4)
        assert np.abs(np.asarray(policy[i]) - np.asarray(copy[i])).max() > 1e-2  # the test can fail


def test_dpo_step_precomputed_and_accumulated_equals_online(prefs):
    """One update with the online LoRA-off reference on 8 pairs == one with precomputed reference
    log-probs over 2 accumulated micro-batches of 4: same metrics, same new weights."""
    import optax
    mesh, model, pairs = prefs
    backbone = model.backbone
    params, frozen = common.split_variables(backbone)
    rng = np.random.default_rng(1)  # a policy away from its reference
    params = [p + 0.3 * rng.standard_normal(p.shape).astype(np.float32) if v.path.endswith("lora_kernel_b") else p
              for v, p in zip(backbone.trainable_variables, params)]
    ref = dpo.lora_off(backbone, params)
    optimizer, args = optax.sgd(0.1), dpo.Args(beta=0.5)
    step = jax.jit(lambda s, f, b, r: dpo.train_step(backbone, optimizer, args, s, f, b, r))
    data = dpo.pad_examples(pairs, 32)
    (online, _), m1 = step((params, optimizer.init(params)), frozen, {k: v[None] for k, v in data.items()}, ref)
    ref_chosen, ref_rejected = jax.jit(lambda p, f, b: dpo.concatenated_forward(backbone, p, f, b))(ref, frozen, data)
    pre = {**data, "ref_chosen_logps": np.asarray(ref_chosen), "ref_rejected_logps": np.asarray(ref_rejected)}
    pre = {k: v.reshape(2, 4, *v.shape[1:]) for k, v in pre.items()}  # [A=2, 4, ...]
    (accumulated, _), m2 = step((params, optimizer.init(params)), frozen, pre, None)
    assert float(m1["rewards/margins"]) != 0 and float(m1["train/grad_norm"]) > 0
    for k in m1:
        assert float(m2[k]) == pytest.approx(float(m1[k]), rel=1e-4, abs=1e-6), k
    for a, b, p in zip(online, accumulated, params):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert any(np.abs(np.asarray(a) - np.asarray(p)).max() > 1e-4 for a, p in zip(online, params))  # it moved


def test_prompt_forms_and_bad_rows(tmp_path):
    gemma = dpo.CHAT_TEMPLATES["gemma"]
    assert dpo.to_triple({"prompt": "Sort: 2 1", "chosen": " 1 2", "rejected": " 2 1"}, "f:1", gemma) == \
        ("Sort: 2 1", " 1 2", " 2 1")
    # implicit prompt: longest common prefix; the split space goes with the responses
    assert dpo.to_triple({"chosen": "Sort: 2 1 1 2", "rejected": "Sort: 2 1 2 1"}, "f:1", gemma) == \
        ("Sort: 2 1", " 1 2", " 2 1")
    user = {"role": "user", "content": "Sort: 2 1"}
    chat = {"chosen": [user, {"role": "assistant", "content": "1 2"}],
            "rejected": [user, {"role": "assistant", "content": "2 1"}]}
    want = ("<start_of_turn>user\nSort: 2 1<end_of_turn>\n<start_of_turn>model\n",
            "1 2<end_of_turn>", "2 1<end_of_turn>")  # as sft.py renders a chat; EOS follows
    assert dpo.to_triple(chat, "f:1", gemma) == want
    explicit = {"prompt": [user], "chosen": chat["chosen"][1:], "rejected": chat["rejected"][1:]}
    assert simpo.to_triple(explicit, "f:1", gemma) == orpo.to_triple(explicit, "f:1", gemma) == want
    for content, message in [
        ('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n',
         "bad.jsonl:2: missing field 'rejected'"),
        ('{"prompt": "a", "chosen": 3, "rejected": "c"}\n', "bad.jsonl:1: field 'chosen' must be a non-empty string"),
        ('{"prompt": "a", "chosen": "b", "rejected": "  "}\n', "bad.jsonl:1: field 'rejected' must be a non-empty"),
        ('{"chosen": "ab", "rejected": "abc"}\n', "bad.jsonl:1: without 'prompt'"),
        ('{"chosen": [{"role": "user"}], "rejected": []}\n', "bad.jsonl:1: field 'chosen' must be a non-empty list"),
        ('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{oops\n', "bad.jsonl:2: invalid JSON"),
    ]:
        (tmp_path / "bad.jsonl").write_text(content)
        for module in (dpo, simpo, orpo):
            with pytest.raises(common.UsageError, match=message):
                module.tokenize_dataset(str(tmp_path / "bad.jsonl"), None, gemma, 512)


# ---------------------------------------------------------------------------
# Each script through its CLI
# ---------------------------------------------------------------------------
SCRIPTS = {"dpo.py": dpo, "simpo.py": simpo, "orpo.py": orpo}


def run(script, *args, check=True):
    """The script as a user runs it: one CPU device (8 simulated devices make a CPU step ~4x slower)."""
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "").replace(
        "--xla_force_host_platform_device_count=8", "").strip()}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), *args], capture_output=True, text=True,
                          cwd=ROOT, env=env)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """`tiny` (seed 0) written as a Hugging Face Gemma directory, as test_loading.py does."""
    model = common.load_model("tiny", common.make_mesh(), "float32", seed=0)
    hf = str(tmp_path_factory.mktemp("hf") / "gemma")
    model.export_to_transformers(hf)
    with open(os.path.join(hf, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump({**config, "architectures": ["GemmaForCausalLM"]}, f)  # keras-hub 0.32 leaves it out
    return hf


def expected_metrics(module, model, pairs):
    """The loss and metrics of `pairs` under the initial model, computed here in-process."""
    params, frozen = common.split_variables(model.backbone)  # LoRA B = 0: the plain initial model
    forward = jax.jit(lambda b: module.concatenated_forward(model.backbone, params, frozen, b))
    logps = forward(dpo.pad_examples(pairs, 32))
    if module is dpo:
        return dpo_loss(*logps, *logps)  # policy == reference
    nll = logps[2].sum() / logps[3].sum()
    return simpo_loss(logps[0], logps[1], nll) if module is simpo else orpo_loss(logps[0], logps[1], nll)


def assert_logged(row, loss, metrics, script):
    assert row["train/loss"] == pytest.approx(float(loss), rel=1e-4)
    for k, v in metrics.items():
        if not (script == "dpo.py" and k == "rewards/accuracies"):  # DPO at init: ties broken by float noise
            assert row[k] == pytest.approx(float(v), rel=1e-4, abs=1e-5), k


def test_issue_command_logs_first_batch_before_any_update(hf_checkpoint, prefs, tmp_path):
    """`--model <HF dir> --dataset <jsonl> --dtype float32 --learning-rate 0 --max-steps 1`."""
    mesh, model, pairs = prefs
    with open(os.path.join(ROOT, "data", "prefs_eval.jsonl")) as f:
        (tmp_path / "pairs.jsonl").write_text("".join(f.readlines()[:8]))
    out = str(tmp_path / "run")
    run("dpo.py", "--model", hf_checkpoint, "--dataset", str(tmp_path / "pairs.jsonl"), "--dtype", "float32",
        "--learning-rate", "0", "--max-steps", "1", "--batch-size", "8", "--eval-dataset", "", "--output-dir", out)
    (row,) = read_metrics(out)
    assert row["step"] == 1 and row["train/loss"] == pytest.approx(LOG2, abs=1e-6)
    assert_logged(row, *expected_metrics(dpo, model, pairs), "dpo.py")


@pytest.fixture(scope="module", params=list(SCRIPTS))
def trained(request, hf_checkpoint, tmp_path_factory):
    """30 steps from the random `tiny` (as an HF directory), every step logged."""
    out = str(tmp_path_factory.mktemp(request.param[:-3]) / "run")
    run(request.param, "--model", hf_checkpoint, "--dataset", os.path.join(ROOT, "data", "prefs_train.jsonl"),
        "--dtype", "float32", "--max-steps", "30", "--log-every", "1", "--eval-every", "30", "--output-dir", out)
    return request.param, out


def test_first_batch_metrics_logged_before_the_update(trained, prefs):
    script, out = trained
    mesh, model, _ = prefs
    module = SCRIPTS[script]
    pairs, _ = module.tokenize_dataset(os.path.join(ROOT, "data", "prefs_train.jsonl"), model.preprocessor.tokenizer,
                                       module.chat_template(model.backbone), 512)
    first = module.get_batch({"chosen_ids": np.arange(len(pairs))}, 0, 32, 1, 0)["chosen_ids"][0]  # batch 0's pairs
    row = read_metrics(out)[1]  # [0] is the step-0 evaluation
    assert row["step"] == 1
    assert_logged(row, *expected_metrics(module, model, [pairs[i] for i in first]), script)


def test_outputs(trained):
    script, out = trained
    files = os.listdir(out)
    assert {"args.json", "metrics.jsonl", "model"} <= set(files)
    assert any(f.startswith("events.out.tfevents") for f in files)
    with open(os.path.join(out, "args.json")) as f:
        assert json.load(f)["max_steps"] == 30
    train = [r for r in read_metrics(out) if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, 31))
    names = {"train/loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
             "logps/chosen", "logps/rejected", "charts/learning_rate", "charts/tokens_per_sec", "charts/mfu"}
    names |= {"nll_loss", "log_odds_ratio", "log_odds_chosen"} if script == "orpo.py" else set()
    assert names <= set(train[-1]) and 0 < train[-1]["charts/mfu"] <= 1
    assert {"config.json", "model.weights.h5", "tokenizer.json"} <= set(os.listdir(os.path.join(out, "model")))


def test_learns_preferences(trained):
    """Held-out preference accuracy well above chance, and the reward margin grows."""
    script, out = trained
    rows = read_metrics(out)
    evals = [r for r in rows if "eval/loss" in r]
    train = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in evals] == [0, 30]
    before, after = evals
    # chance: 0.5 (σ = 0.035 on 200 pairs). ORPO's rewards compare per-token mean log-probs, and its
    # preference term is weighted by λ = 0.1 next to the NLL: it separates pairs more slowly.
    assert after["eval/rewards/accuracies"] >= (0.6 if script == "orpo.py" else 0.7), (before, after)
    if script == "orpo.py":
        assert after["eval/log_odds_ratio"] > before["eval/log_odds_ratio"]
    with open(os.path.join(out, "args.json")) as f:
        beta = json.load(f)["beta"]  # margins are β-scaled: compare them in nats of log-prob
    assert (after["eval/rewards/margins"] - before["eval/rewards/margins"]) / beta > 0.03, (before, after)
    early, late = (np.mean([r["rewards/margins"] for r in train[i:i + 10]]) for i in (0, 20))
    assert late > early, (early, late)
    assert after["eval/loss"] < before["eval/loss"]


def test_bad_row_exits_2_naming_file_and_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a"}\n')
    proc = run("orpo.py", "--dataset", str(tmp_path / "bad.jsonl"), "--output-dir", str(tmp_path / "out"), check=False)
    assert proc.returncode == 2 and "bad.jsonl:2: missing field 'chosen'" in proc.stderr
    assert "Traceback" not in proc.stderr and not os.path.exists(tmp_path / "out")


def test_lora_precomputed_reference_checkpoint_and_resume(tmp_path):
    """--lora-rank with --precompute-ref saves a model; --save-every/--resume continue the run;
    an --output-dir holding a run is refused without --resume/--overwrite."""
    out = str(tmp_path / "run")
    with open(os.path.join(ROOT, "data", "prefs_eval.jsonl")) as f:
        (tmp_path / "pairs.jsonl").write_text("".join(f.readlines()[:16]))
    common_flags = ["--dataset", str(tmp_path / "pairs.jsonl"), "--eval-dataset", "",
                    "--batch-size", "8", "--lora-rank", "2", "--precompute-ref", "--log-every", "1",
                    "--save-every", "2", "--output-dir", out]
    run("dpo.py", "--max-steps", "2", *common_flags)
    assert {"model", "checkpoints"} <= set(os.listdir(out)) and "2" in os.listdir(os.path.join(out, "checkpoints"))
    refused = run("dpo.py", "--max-steps", "4", *common_flags, check=False)
    assert refused.returncode == 2 and "already holds a run" in refused.stderr
    resumed = run("dpo.py", "--max-steps", "4", "--resume", *common_flags)
    assert "resumed from step 2" in resumed.stdout
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    assert read_metrics(out)[0]["train/loss"] == pytest.approx(LOG2, abs=1e-6)  # LoRA B = 0: policy == reference
