"""evaluate.py: win rate and KL by hand and in float64 NumPy, a worked example on `tiny`
(scores re-derived from the decoded outputs, KL = 0 and win rate 0.5 against itself, greedy
== KerasHub's own generate), bad flags exit 2; compare.py end to end with a tiny budget."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import common  # noqa: F401  (first: KERAS_BACKEND=jax)
import jax
import jax.numpy as jnp

import compare
import evaluate
from evaluate import response_lengths, sequence_kl, win_rate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------
# The protocol's arithmetic
# ---------------------------------------------------------------------------
def test_win_rate_by_hand():
    # wins 1, ties 2 (½ each), losses 1 -> (1 + 2·½ + 0) / 4
    assert win_rate([1.0, 0.5, 0.5, 0.0], [0.0, 0.5, 0.5, 1.0]) == (1 + 2 * 0.5) / 4
    assert win_rate([2.0, 3.0], [1.0, 1.0]) == 1.0
    assert win_rate([0.0], [1.0]) == 0.0


def test_sequence_kl_by_hand_numpy_and_masking():
    logps = jnp.array([[-1.0, -2.0, -3.0]])
    base = jnp.array([[-2.0, -2.5, -100.0]])
    mask = jnp.array([[True, True, False]])  # the third token is padding: it must not count
    np.testing.assert_allclose(sequence_kl(logps, base, mask), [(-1 + 2) + (-2 + 2.5)])
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(16, 12)), rng.normal(size=(16, 12))
    m = rng.random((16, 12)) < 0.7
    expected = np.sum(np.where(m, a - b, 0.0), axis=1)  # float64
    np.testing.assert_allclose(sequence_kl(jnp.array(a), jnp.array(b), jnp.array(m)), expected, rtol=1e-5)
    assert (sequence_kl(jnp.array(a), jnp.array(a), jnp.array(m)) == 0).all()  # identical models: exactly 0


def test_response_lengths_exclude_eos():
    eos = 1
    responses = np.array([[5, 1, 0, 0], [5, 6, 7, 8], [1, 0, 0, 0]])
    lengths, has_eos = response_lengths(responses, np.array([1, 3, 0]), eos)
    np.testing.assert_array_equal(lengths, [1, 4, 0])  # no EOS: all R tokens count
    np.testing.assert_array_equal(has_eos, [True, False, True])


# ---------------------------------------------------------------------------
# evaluate.py on a known model / scorer pair
# ---------------------------------------------------------------------------
def test_evaluate_worked_example(tmp_path):
    """tiny (seed 0) against itself, scored by a reward fn that counts the digit 4 in a response."""
    scorer = tmp_path / "count4.py"
    scorer.write_text("def count4(prompts, responses):\n    return [float(r.count('4')) for r in responses]\n")
    out = tmp_path / "eval"
    evaluate.main(evaluate.Args(model="tiny", baseline="tiny", reward_fn=f"{scorer}:count4", num_prompts=12,
                                num_examples=12, max_new_tokens=8, batch_size=8, output_dir=str(out)))
    result = json.loads((out / "eval.json").read_text())
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == result["num_prompts"] == 12
    # The task score is the mean of the scorer over the decoded responses.
    assert result["score"] == np.mean([s["greedy"].count("4") for s in samples])
    assert result["score_sampled"] == np.mean([s["sampled"].count("4") for s in samples])
    assert [s["greedy_score"] for s in samples] == [float(s["greedy"].count("4")) for s in samples]
    # Against itself: identical responses and log-probs -> KL exactly 0, every prompt a tie.
    assert result["kl"] == 0.0 and result["win_rate"] == 0.5
    assert result["baseline_score"] == result["score"]
    assert [s["baseline_greedy"] for s in samples] == [s["greedy"] for s in samples]
    assert 0 <= result["length"] <= 8 and 0 <= result["eos_rate"] <= 1

    # Deterministic for a seed: the same sampled responses again, from a fresh load.
    args = evaluate.Args(model="tiny", num_prompts=12, max_new_tokens=8, batch_size=8)
    mesh = common.make_mesh(None)
    policy = evaluate.load_policy("tiny", mesh, args)
    prompts, _ = evaluate.check_args(args, mesh)
    data = evaluate.prepare(args, mesh, prompts, policy.model.preprocessor.tokenizer)
    again = evaluate.respond(policy, data, "sampled", jax.random.key(0), data["batch_size"], mesh)
    assert again["texts"] == [s["sampled"] for s in samples]

    # The greedy responses are KerasHub's own greedy generate (an independent sampler); prompts
    # of one token length share a call (KerasHub fills a batch up to one max_length).
    tokenizer = policy.model.preprocessor.tokenizer
    n = len(tokenizer.tokenize(samples[0]["prompt"])) + 1  # + BOS
    same = [s for s in samples if len(tokenizer.tokenize(s["prompt"])) + 1 == n][:4]
    outs = policy.model.generate([s["prompt"] for s in same], max_length=n + 8, strip_prompt=True)
    assert list(outs) == [s["greedy"] for s in same]


def test_evaluate_bad_flags_exit_2(tmp_path, monkeypatch):
    """Bad input: one line on stderr, exit 2, before any model loads (through the CLI once; in
    process, the UsageError that the CLI turns into that line, naming the flag)."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "evaluate.py"), "--reward-fn", "nope.py:f"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.startswith("error: --reward-fn"), out.stderr[-500:]
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr[-500:]
    loads = []
    monkeypatch.setattr(common, "load_model", lambda *a, **k: loads.append(a) or pytest.fail("a model loaded"))
    cases = [({"model": "no_such_model"}, "--model"), ({"prompts": str(tmp_path / "missing.jsonl")}, "--prompts"),
             ({"batch_size": 3}, "--batch-size"), ({"reward_model": str(tmp_path)}, "--reward-model"),
             ({"reward_fn": None}, "--reward-fn"), ({"temperature": 0.0}, "--temperature")]
    for flags, named in cases:
        with pytest.raises(common.UsageError) as e:
            evaluate.main(evaluate.Args(output_dir=str(tmp_path / "e"), **flags))
        assert named in str(e.value) and len(str(e.value).splitlines()) == 1, (flags, str(e.value))
    assert not loads and not (tmp_path / "e").exists()


# ---------------------------------------------------------------------------
# compare.py
# ---------------------------------------------------------------------------
def test_compare_plan_reward_model_for_ppo(tmp_path):
    args = compare.Args(methods="sft,dpo,ppo", dpo_args="--beta 0.2 --learning-rate 1e-5", steps=7,
                        output_dir=str(tmp_path))
    stages, base = compare.plan(args, str(tmp_path))
    names = [s["name"] for s in stages]
    assert names == ["sft", "dpo", "reward", "ppo", "ppo_fn"] and base == str(tmp_path / "sft" / "model")
    dpo, ppo, ppo_fn = stages[1]["flags"], stages[3]["flags"], stages[4]["flags"]
    assert dpo[dpo.index("--model") + 1] == base and dpo[dpo.index("--max-steps") + 1] == "7"
    assert dpo[-4:] == ["--beta", "0.2", "--learning-rate", "1e-5"]  # pass-through comes last: it overrides
    assert ppo[ppo.index("--reward-model") + 1] == str(tmp_path / "reward" / "model")
    assert stages[3]["needs"] == ["sft", "reward"] and stages[4]["needs"] == ["sft"]
    assert ppo_fn[ppo_fn.index("--reward-fn") + 1] == args.reward_fn and "--reward-model" not in ppo_fn
    only_fn, _ = compare.plan(compare.Args(methods="ppo", ppo_reward="fn"), str(tmp_path))
    assert [s["name"] for s in only_fn] == ["ppo"] and "--model" in only_fn[0]["flags"]
    assert only_fn[0]["flags"][only_fn[0]["flags"].index("--model") + 1] == "tiny"  # no sft: from --model
    grpo = compare.plan(compare.Args(methods="sft,grpo", grpo_steps=5, grpo_args="--beta 0"), str(tmp_path))[0][1]
    assert grpo["name"] == "grpo" and grpo["needs"] == ["sft"]
    assert grpo["flags"][grpo["flags"].index("--max-steps") + 1] == "5" and grpo["flags"][-2:] == ["--beta", "0"]
    assert grpo["flags"][grpo["flags"].index("--reward-fn") + 1] == compare.Args().reward_fn


def test_compare_end_to_end_tiny_budget(tmp_path):
    """sft 20 steps, then dpo and a forked dpo (--extra) 4 steps each: one table row per method, the image."""
    fork = tmp_path / "mydpo.py"
    fork.write_text(open(os.path.join(ROOT, "dpo.py")).read())
    out = tmp_path / "cmp"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "compare.py"), "--model", "tiny", "--methods", "sft,dpo",
                           "--extra", str(fork), "--sft-steps", "20", "--steps", "4", "--num-prompts", "16",
                           "--dpo-args=--beta 0.2", "--output-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "XLA_FLAGS": ""})  # one CPU device: 3 scripts compile faster
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    md = (out / "comparison.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| **")]
    assert [r.split("**")[1] for r in rows] == ["sft", "dpo", "mydpo"]
    cells = {r.split("**")[1]: [c.strip() for c in r.split("|")[2:-1]] for r in rows}
    assert cells["sft"][2:4] == ["0.500", "0.000"]  # SFT against itself: win rate ½, KL 0
    assert float(cells["dpo"][3]) != 0.0  # DPO moved away from SFT
    assert (out / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "dpo" / "args.json").read_text())["beta"] == 0.2  # pass-through reached dpo.py
    for name in ("sft", "dpo", "mydpo"):
        assert json.loads((out / name / "eval" / "eval.json").read_text())["num_prompts"] == 16
    assert "| **sft**" in proc.stdout  # the table is printed at the end
