"""dpo.py, simpo.py, orpo.py beyond their losses and log-prob helpers (those are in
test_losses.py): the reference model three ways, one DPO step precomputed + accumulated ==
online, data validation, and each script through its CLI on `tiny` (outputs, first-batch
metrics before any update, learning)."""

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
from helpers import ROOT, learning_env, metrics as read_metrics, one_device_env, usage_error
from orpo import orpo_loss
from simpo import simpo_loss

LOG2 = math.log(2)


# ---------------------------------------------------------------------------
# The reference model (tiny, in process; `prefs` is in conftest.py) and data
# ---------------------------------------------------------------------------
def test_reference_logps_agree_three_ways(prefs):
    """πref = the initial model, whether a frozen copy of the full weights, the LoRA-off
    base of a trained LoRA policy, or log-probs precomputed in one pass."""
    mesh, model, pairs = prefs
    data = dpo.pad_examples(pairs, 32)
    lora_params, frozen = common.split_variables(model.backbone)
    plain = common.load_model("tiny", mesh, "float32", seed=0)  # the same base weights, no LoRA
    full_params, full_frozen = common.split_variables(plain.backbone)
    ref_copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p))(full_params)
    # jitted, as the scripts run them: eager ops on arrays sharded over 8 simulated CPU devices have aborted
    # the process (XLA:CPU, "Fatal Python error: Aborted") about once in a dozen suites
    copy = jax.jit(lambda p, d: dpo.reference_logps(plain.backbone, p, full_frozen, d))(ref_copy, data)
    # A "trained" LoRA policy (B factors non-zero) differs from the base; its LoRA-off reference does not.
    rng = np.random.default_rng(0)
    trained = [
        p + 0.5 * rng.standard_normal(p.shape).astype(np.float32) if v.path.endswith("lora_kernel_b") else p
        for v, p in zip(model.backbone.trainable_variables, lora_params)
    ]
    policy = jax.jit(lambda p, d: dpo.concatenated_forward(model.backbone, p, frozen, d)[0])(trained, data)
    bb = model.backbone
    lora_ref = jax.jit(lambda p, d: dpo.reference_logps(bb, dpo.lora_off(bb, p), frozen, d))
    lora = lora_ref(trained, data)
    fwd = jax.jit(
        lambda p, b: dpo.reference_logps(plain.backbone, p, full_frozen, jax.tree.map(lambda x: x[0], b))
    )
    pre = common.per_example(lambda b: fwd(full_params, b), data, 8, mesh)
    precomputed = dpo.reference_logps(None, None, None, {**data, **pre})
    for side in ("chosen", "rejected"):
        k = f"ref_{side}_logps"
        np.testing.assert_allclose(np.asarray(lora[k]), np.asarray(copy[k]), rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(np.asarray(precomputed[k]), np.asarray(copy[k]), rtol=1e-5, atol=1e-4)
        assert np.abs(np.asarray(policy[f"{side}_logps"]) - np.asarray(copy[k])).max() > 1e-2  # it can fail


def test_dpo_step_precomputed_and_accumulated_equals_online(prefs):
    """One update with the online LoRA-off reference on 8 pairs == one with precomputed reference
    log-probs over 2 accumulated micro-batches of 4: same metrics, same new weights."""
    import optax

    mesh, model, pairs = prefs
    backbone = model.backbone
    params, frozen = common.split_variables(backbone)
    rng = np.random.default_rng(1)  # a policy away from its reference
    params = [
        p + 0.3 * rng.standard_normal(p.shape).astype(np.float32) if v.path.endswith("lora_kernel_b") else p
        for v, p in zip(backbone.trainable_variables, params)
    ]
    ref = dpo.lora_off(backbone, params)
    optimizer, args = optax.sgd(0.1), dpo.Args(beta=0.5, sft_weight=0.7)  # with RPO's NLL term
    step = jax.jit(lambda s, f, b, r: dpo.train_step(backbone, optimizer, args, s, f, b, r))
    data = dpo.pad_examples(pairs, 32)
    (online, _), m1 = step(
        (params, optimizer.init(params)), frozen, {k: v[None] for k, v in data.items()}, ref
    )
    ref_logps = jax.device_get(
        jax.jit(lambda p, f, b: dpo.reference_logps(backbone, p, f, b))(ref, frozen, data)
    )
    pre = {k: v.reshape(2, 4, *v.shape[1:]) for k, v in {**data, **ref_logps}.items()}  # [A=2, 4, ...]
    (accumulated, _), m2 = step((params, optimizer.init(params)), frozen, pre, None)
    assert float(m1["rewards/margins"]) != 0 and float(m1["train/grad_norm"]) > 0
    # the NLL is the token mean over the whole update (not a mean of micro-batch means), inside the loss
    policy = jax.jit(lambda p, f, b: dpo.concatenated_forward(backbone, p, f, b)[0])(params, frozen, data)
    nll = -float(np.asarray(policy["chosen_logps"]).sum()) / data["chosen_loss_mask"][:, 1:].sum()
    assert float(m1["nll_loss"]) == pytest.approx(nll, rel=1e-5)
    sides = ("chosen_logps", "rejected_logps")
    dpo_part = dpo_loss(*(policy[k] for k in sides), *(ref_logps[f"ref_{k}"] for k in sides), beta=0.5)[0]
    assert float(m1["train/loss"]) == pytest.approx(float(dpo_part) + 0.7 * nll, rel=1e-5)
    for k in m1:
        assert float(m2[k]) == pytest.approx(float(m1[k]), rel=1e-4, abs=1e-6), k
    for a, b, p in zip(online, accumulated, params):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert any(np.abs(np.asarray(a) - np.asarray(p)).max() > 1e-4 for a, p in zip(online, params))  # it moved


def test_prompt_forms_and_bad_rows(tmp_path, prefs):
    """Rows -> (prompt, chosen, rejected) texts (common.py, shared by the three scripts), then each
    script's tokenize_dataset, which refuses a dataset where no pair fits --max-length."""
    triple = common.preference_triple
    gemma = common.CHAT_TEMPLATES["gemma"]
    assert triple({"prompt": "Sort: 2 1", "chosen": " 1 2", "rejected": " 2 1"}, "f:1", gemma) == (
        "Sort: 2 1",
        " 1 2",
        " 2 1",
    )
    # implicit prompt: longest common prefix; the split space goes with the responses
    assert triple({"chosen": "Sort: 2 1 1 2", "rejected": "Sort: 2 1 2 1"}, "f:1", gemma) == (
        "Sort: 2 1",
        " 1 2",
        " 2 1",
    )
    user = {"role": "user", "content": "Sort: 2 1"}
    chat = {
        "chosen": [user, {"role": "assistant", "content": "1 2"}],
        "rejected": [user, {"role": "assistant", "content": "2 1"}],
    }
    want = (
        "<start_of_turn>user\nSort: 2 1<end_of_turn>\n<start_of_turn>model\n",
        "1 2<end_of_turn>",
        "2 1<end_of_turn>",
    )  # as sft.py renders a chat; EOS follows
    assert triple(chat, "f:1", gemma) == want
    explicit = {"prompt": [user], "chosen": chat["chosen"][1:], "rejected": chat["rejected"][1:]}
    assert triple(explicit, "f:1", gemma) == want
    for content, message in [
        (
            '{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n',
            "bad.jsonl:2: missing field 'rejected'",
        ),
        (
            '{"prompt": "a", "chosen": 3, "rejected": "c"}\n',
            "bad.jsonl:1: field 'chosen' must be a non-empty string",
        ),
        (
            '{"prompt": "a", "chosen": "b", "rejected": "  "}\n',
            "bad.jsonl:1: field 'rejected' must be a non-empty",
        ),
        ('{"chosen": "ab", "rejected": "abc"}\n', "bad.jsonl:1: without 'prompt'"),
        (
            '{"chosen": [{"role": "user"}], "rejected": []}\n',
            "bad.jsonl:1: field 'chosen' must be a non-empty list",
        ),
        ('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{oops\n', "bad.jsonl:2: invalid JSON"),
        (  # another script's data: said so, and which script takes it
            '{"prompt": "a", "completion": "b"}\n',
            "bad.jsonl:1: missing field 'chosen' .*; this row looks like SFT data: sft.py trains on it",
        ),
        (
            '{"prompt": "a", "completion": "b", "label": true}\n',
            r"bad.jsonl:1: .* looks like KTO's unpaired data \(prompt, completion, label\): kto.py trains",
        ),
        (
            json.dumps({**explicit, "prompt": [{"role": "tool", "content": "7"}]}) + "\n",
            "bad.jsonl:1: field 'prompt', turn 1: unknown role 'tool'",
        ),
        (
            json.dumps({**explicit, "chosen": [{"role": "assistant", "content": ""}]})
            + "\n",  # nothing to train on
            "bad.jsonl:1: 'chosen' must continue the prompt with an assistant turn with text",
        ),
    ]:
        (tmp_path / "bad.jsonl").write_text(content)
        with pytest.raises(common.UsageError, match=message):
            common.read_dataset(str(tmp_path / "bad.jsonl"), "preference", gemma)
    tokenizer = prefs[1].preprocessor.tokenizer
    long = [("Sort: 2 1 " * 20, " 1 2", " 2 1")]  # a long prompt, short responses
    for module in (dpo, simpo, orpo):
        pairs, counts = module.tokenize_dataset(long, tokenizer, 16, "f.jsonl")  # prompt cut from the left
        assert counts == {"examples": 1, "truncated": 1, "dropped": 0} and len(pairs[0][0][0]) == 16
        with pytest.raises(common.UsageError, match="f.jsonl: every pair is longer than --max-length 3"):
            module.tokenize_dataset(long, tokenizer, 3, "f.jsonl")  # BOS + EOS + a response > 3


# ---------------------------------------------------------------------------
# Each script through its CLI
# ---------------------------------------------------------------------------
SCRIPTS = {"dpo.py": dpo, "simpo.py": simpo, "orpo.py": orpo}


def run(script, *args, check=True, env=None):
    """The script as a user runs it: one CPU device (8 simulated devices make a CPU step ~4x slower)."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, script), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env or one_device_env(),
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


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
    forward = jax.jit(lambda b: module.concatenated_forward(model.backbone, params, frozen, b)[0])
    data = dpo.pad_examples(pairs, 32)
    logps = forward(data)
    chosen, rejected = logps["chosen_logps"], logps["rejected_logps"]
    if module is dpo:  # policy == reference; the NLL is logged at --sft-weight 0 too
        return dpo_loss(
            chosen,
            rejected,
            chosen,
            rejected,
            nll_loss=logps["nll"].sum() / data["chosen_loss_mask"][:, 1:].sum(),
        )
    nll = logps["nll"].sum() / logps["nll_tokens"].sum()
    return simpo_loss(chosen, rejected, nll) if module is simpo else orpo_loss(chosen, rejected, nll)


def assert_logged(row, loss, metrics, script):
    assert row["train/loss"] == pytest.approx(float(loss), rel=1e-4)
    for k, v in metrics.items():
        if not (script == "dpo.py" and k == "rewards/accuracies"):  # DPO at init: ties broken by float noise
            assert row[k] == pytest.approx(float(v), rel=1e-4, abs=1e-5), k


def test_issue_command_logs_first_batch_before_any_update(hf_checkpoint, prefs, tmp_path):
    """`--model <HF dir> --dataset <jsonl> --dtype float32 --max-steps 1`: the logged row is the
    initial model on the first batch, whatever the learning rate (metrics come from the forward
    before the update; `--learning-rate 0` itself is refused by plumbing.Run: it must be > 0)."""
    mesh, model, pairs = prefs
    with open(os.path.join(ROOT, "data", "prefs_eval.jsonl")) as f:
        (tmp_path / "pairs.jsonl").write_text("".join(f.readlines()[:8]))
    out = str(tmp_path / "run")
    run(
        "dpo.py",
        "--model",
        hf_checkpoint,
        "--dataset",
        str(tmp_path / "pairs.jsonl"),
        "--dtype",
        "float32",
        "--max-steps",
        "1",
        "--batch-size",
        "8",
        "--eval-dataset",
        "",
        "--output-dir",
        out,
    )
    (row,) = read_metrics(out)
    assert row["step"] == 1 and row["train/loss"] == pytest.approx(LOG2, abs=1e-6)
    assert_logged(row, *expected_metrics(dpo, model, pairs), "dpo.py")


@pytest.fixture(scope="module", params=list(SCRIPTS))
def trained(request, hf_checkpoint, tmp_path_factory):
    """30 steps from the random `tiny` (as an HF directory), every step logged."""
    out = str(tmp_path_factory.mktemp(request.param[:-3]) / "run")
    tiny = [
        "--batch-size",
        "32",
        "--learning-rate",
        "3e-4",
        "--warmup-steps",
        "5",  # `tiny` from scratch,
        "--lr-scheduler-type",
        "cosine_with_min_lr",
    ]  # the schedule the thresholds below were measured with
    tiny += (
        ["--grad-accum-steps", "1", "--gamma", "0.5"] if request.param == "simpo.py" else []
    )  # SimPO: paper's
    run(
        request.param,
        "--model",
        hf_checkpoint,
        "--dataset",
        os.path.join(ROOT, "data", "prefs_train.jsonl"),
        "--dtype",
        "float32",
        "--max-steps",
        "30",
        *tiny,
        "--log-every",
        "1",
        "--eval-every",
        "30",
        "--output-dir",
        out,
        env=learning_env(),
    )
    return request.param, out


def test_first_batch_metrics_logged_before_the_update(trained, prefs):
    script, out = trained
    mesh, model, _ = prefs
    module = SCRIPTS[script]
    path = os.path.join(ROOT, "data", "prefs_train.jsonl")
    triples = common.read_dataset(path, "preference", common.chat_template("tiny"))
    pairs, _ = module.tokenize_dataset(triples, model.preprocessor.tokenizer, 512, path)
    args = module.Args(batch_size=32, grad_accum_steps=1, seed=0)  # as the `trained` run
    lengths = np.ones((len(pairs), 2), int)  # the order does not depend on them (no --group-by-length)
    width = common.bucket_length(1, args.max_length)  # the bucket get_batch cuts these lengths to
    ids = {"chosen_ids": np.repeat(np.arange(len(pairs))[:, None], width, 1)}  # each row holds its index
    first = module.get_batch(ids, lengths, 0, args)[0]["chosen_ids"][0, :, 0]  # batch 0's pairs
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
    names = {
        "train/loss",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "charts/learning_rate",
        "charts/tokens_per_sec",
        "charts/mfu",
    }
    names |= {"nll_loss", "log_odds_ratio", "log_odds_chosen"} if script == "orpo.py" else set()
    assert names <= set(train[-1]) and 0 < train[-1]["charts/mfu"] <= 1
    assert {"config.json", "model.weights.h5", "tokenizer.json"} <= set(
        os.listdir(os.path.join(out, "model"))
    )


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
    early, late = (np.mean([r["rewards/margins"] for r in train[i : i + 10]]) for i in (0, 20))
    assert late > early, (early, late)
    assert after["eval/loss"] < before["eval/loss"]


def test_bad_row_is_refused_naming_file_and_line(tmp_path):
    import orpo  # in this process: the UsageError main raises before any compute

    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a"}\n')
    message = usage_error(
        orpo, "--dataset", str(tmp_path / "bad.jsonl"), "--output-dir", str(tmp_path / "out")
    )
    assert "bad.jsonl:2: missing field 'chosen'" in message and not os.path.exists(tmp_path / "out")


def test_lora_precomputed_reference_checkpoint_and_resume(tmp_path):
    """--lora-rank with --precompute-ref saves a model; --save-every/--resume continue the run;
    an --output-dir holding a run is refused without --resume/--overwrite."""
    out = str(tmp_path / "run")
    with open(os.path.join(ROOT, "data", "prefs_eval.jsonl")) as f:
        (tmp_path / "pairs.jsonl").write_text("".join(f.readlines()[:16]))
    common_flags = [
        "--dataset",
        str(tmp_path / "pairs.jsonl"),
        "--eval-dataset",
        "",
        "--batch-size",
        "8",
        "--lora-rank",
        "2",
        "--precompute-ref",
        "--log-every",
        "1",
        "--save-every",
        "2",
        "--output-dir",
        out,
    ]
    run("dpo.py", "--max-steps", "2", *common_flags)
    assert {"model", "checkpoints"} <= set(os.listdir(out)) and "2" in os.listdir(
        os.path.join(out, "checkpoints")
    )
    assert "already holds a finished run" in usage_error(dpo, "--max-steps", "4", *common_flags)  # in-process
    resumed = run("dpo.py", "--max-steps", "4", "--resume", *common_flags)
    assert "resumed from step 2" in resumed.stdout
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    assert read_metrics(out)[0]["train/loss"] == pytest.approx(
        LOG2, abs=1e-6
    )  # LoRA B = 0: policy == reference
