"""Length buckets: each batch is padded to the bucket of its longest sequence, not to the run's
longest; the step compiles at most once per bucket; --resume stays exact across a bucket change;
--group-by-length pads less, over the same examples; the RL rollouts cut their queries to the bucket of
their batch's longest prompt, sampling and scoring the tokens they would at the run's width."""

import functools
import json
import os
import re
import shutil

import h5py
import numpy as np
import pytest

import common
import sft
from helpers import ROOT, metrics, one_device_env, run_script

LADDER_1024 = [32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]


def test_bucket_ladder():
    # Powers of two and their 1.5x midpoints from 32, capped at --max-length.
    assert [common.bucket_length(n, 1024) for n in (1, 32, 33, 48, 49, 65, 97, 129, 600, 769, 1024)] == [
        32,
        32,
        48,
        48,
        64,
        96,
        128,
        192,
        768,
        1024,
        1024,
    ]
    assert sorted({common.bucket_length(n, 1024) for n in range(1, 1025)}) == LADDER_1024
    assert common.bucket_length(700, 600) == 600 and common.bucket_length(20, 24) == 24
    # The waste bound: a batch pads at most 1/3 of its length past its longest sequence.
    assert max(1 - n / common.bucket_length(n, 4096) for n in range(33, 4097)) <= 1 / 3


def long_tail(n, seed=0):
    """Log-normal lengths with median 64 and p99 about 8x that, within 1..1024."""
    return np.clip(np.random.default_rng(seed).lognormal(np.log(64), np.log(8) / 2.326, n), 1, 1024).astype(
        int
    )


def test_length_batch_buckets_the_whole_batch_and_grouping_pads_less():
    lengths, bs = long_tail(4000), 8
    plain = [common.length_batch(lengths, s, bs, 0, 1024) for s in range(100)]
    grouped = [common.length_batch(lengths, s, bs, 0, 1024, group=True) for s in range(100)]
    for idx, length, real in plain + grouped:
        assert length == common.bucket_length(lengths[idx].max(), 1024) and real == lengths[idx].sum()
    # Plain order: within an epoch (4000 / 8 = 500 steps) no example repeats; grouping deals out the same ones.
    assert len(set(np.concatenate([p[0] for p in plain]).tolist())) == 100 * bs
    assert sorted(np.concatenate([g[0] for g in grouped])) == sorted(np.concatenate([p[0] for p in plain]))
    assert [g[0].tolist() for g in grouped] == [
        common.length_batch(lengths, s, bs, 0, 1024, True)[0].tolist() for s in range(100)
    ]  # a pure function of (seed, step)
    waste = lambda batches: 1 - sum(r for _, _, r in batches) / sum(bs * t for _, t, _ in batches)
    run_wide = 1 - lengths.mean() / common.bucket_length(lengths.max(), 1024)
    # Measured: 0.91 of the tokens are padding at the run-wide length, 0.69 per batch, 0.25 grouped.
    assert waste(grouped) < 0.3 < 0.6 < waste(plain) < 0.8 < run_wide, (
        waste(grouped),
        waste(plain),
        run_wide,
    )
    # Pairs: the bucket holds the longer sequence of each pair; real tokens count both.
    pairs = np.stack([lengths, lengths // 2], -1)
    idx, length, real = common.length_batch(pairs, 3, bs, 0, 1024)
    assert length == common.bucket_length(lengths[idx].max(), 1024) and real == pairs[idx].sum()


def test_get_batch_pads_each_batch_to_its_bucket():
    rng = np.random.default_rng(1)
    examples = [
        (rng.integers(3, 100, n).astype(np.int32), rng.random(n) < 0.5) for n in long_tail(64, 1) // 4 + 2
    ]
    data = sft.pad_examples(examples, common.bucket_length(max(len(x) for x, _ in examples), 1024))
    lengths = data["padding_mask"].sum(-1)
    args = sft.Args(batch_size=8, grad_accum_steps=2, max_length=1024)
    seen = set()
    for step in range(16):
        batch, (real, padded) = sft.get_batch(data, lengths, step, args)
        idx = common.length_batch(lengths, step, 8, 0, 1024)[0]  # the examples of this step
        t = batch["token_ids"].shape[-1]
        assert batch["token_ids"].shape == (2, 4, t) and t == common.bucket_length(lengths[idx].max(), 1024)
        assert (padded, real) == (8 * t, lengths[idx].sum())
        for row, i in zip(batch["token_ids"].reshape(8, t), idx):  # real tokens intact, the rest padding
            assert (row[: len(examples[i][0])] == examples[i][0]).all() and not row[
                len(examples[i][0]) :
            ].any()
        seen.add(t)
    assert len(seen) >= 3  # the batches really differ in length


def test_per_example_in_length_order_matches_one_shape():
    import jax

    mesh = common.make_mesh()
    rng = np.random.default_rng(2)
    n, full = 37, 256
    lengths = rng.integers(1, full + 1, n)
    data = {
        "ids": np.where(np.arange(full) < lengths[:, None], rng.integers(1, 9, (n, full)), 0),
        "weight": rng.random(n),
    }
    fn = jax.jit(
        lambda b: ((b["ids"][0] ** 2).sum(-1) * b["weight"][0], b["ids"].shape[-1] + 0 * b["weight"][0])
    )
    one_shape, _ = common.per_example(fn, data, 8, mesh)
    bucketed, widths = common.per_example(fn, data, 8, mesh, lengths, full)
    np.testing.assert_allclose(bucketed, one_shape, rtol=1e-6)
    # Batches in length order: widths grow with length, each holds its example, padding shrinks.
    assert (widths >= lengths).all() and (np.diff(widths[np.argsort(lengths, kind="stable")]) >= 0).all()
    assert widths.sum() < 0.8 * n * full


# ---------------------------------------------------------------------------
# End to end: sft.py on mixed-length data
# ---------------------------------------------------------------------------
def mixed_rows(n=160, seed=0):
    """Toy sorting rows of 2..40 digits, most of them short (a long tail of lengths)."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in np.clip(rng.lognormal(np.log(5), 0.8, n), 2, 40).astype(int):
        digits = rng.integers(0, 10, k)
        rows.append(
            {
                "prompt": "Sort: " + " ".join(map(str, digits)),
                "completion": " " + " ".join(map(str, sorted(digits))),
            }
        )
    return rows


FLAGS = [
    "--model",
    "tiny",
    "--batch-size",
    "8",
    "--learning-rate",
    "1e-3",
    "--max-length",
    "128",
    "--group-by-length",
    "--log-every",
    "1",
    "--save-every",
    "4",
    "--max-steps",
    "8",
    "--eval-dataset",
    "",
    "--num-samples",
    "0",
    "--seed",
    "1",
]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """One clean 8-step run (checkpoints at 4 and 8) with JAX's compile log, and its data's buckets."""
    base = tmp_path_factory.mktemp("buckets")
    path = base / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in mixed_rows()))
    env = {**one_device_env(), "JAX_LOG_COMPILES": "1"}
    res = run_script("sft.py", *FLAGS, "--dataset", str(path), "--output-dir", str(base / "clean"), env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    import keras_hub

    tokenizer = keras_hub.models.GemmaTokenizer(proto=common.TINY_TOKENIZER)
    segs = common.read_dataset(str(path), "sft", None)
    examples, _ = sft.tokenize_dataset(segs, tokenizer, 128, True, str(path))
    lengths = np.array([len(x) for x, _ in examples])
    batches = [common.length_batch(lengths, s, 8, 1, 128, group=True) for s in range(8)]
    return {
        "data": str(path),
        "clean": str(base / "clean"),
        "log": res.stderr,
        "batches": batches,
        "buckets": [length for _, length, _ in batches],
    }


def test_mixed_lengths_compile_once_per_bucket(mixed):
    compiles = len(re.findall(r"Compiling jit\(train_step\)", mixed["log"]))
    rows = metrics(mixed["clean"])
    assert (
        2 <= len(set(mixed["buckets"])) == compiles == rows[-1]["charts/compilations"] <= 5
    )  # 32, 48, 64, 96, 128
    # Per step (--log-every 1): the padding is what that batch's bucket leaves empty, and tokens/s counts
    # only real tokens.
    expected = [1 - real / (8 * length) for _, length, real in mixed["batches"]]
    assert [r["charts/padding_fraction"] for r in rows] == pytest.approx(expected, abs=1e-12)
    assert len(set(expected)) > 1


def test_resume_across_a_bucket_change_is_bit_exact(mixed, tmp_path):
    b = mixed["buckets"]
    assert b[3] != b[4], b  # step 4 (the first after the checkpoint) pads to another length than step 3
    cut = tmp_path / "cut"
    shutil.copytree(mixed["clean"], cut)
    shutil.rmtree(cut / "checkpoints" / "8")
    shutil.rmtree(cut / "model")
    res = run_script(
        "sft.py",
        *FLAGS,
        "--dataset",
        mixed["data"],
        "--output-dir",
        str(cut),
        "--resume",
        env=one_device_env(),
    )
    assert res.returncode == 0 and "resumed from step 4" in res.stdout, res.stderr[-3000:]
    drop = ("charts/tokens_per_sec", "charts/mfu", "charts/compilations")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in drop} for r in rows]
    assert strip(metrics(cut)) == strip(metrics(mixed["clean"]))  # every value, bit for bit
    weights = lambda d: h5py.File(os.path.join(d, "model", "model.weights.h5"), "r")
    with weights(mixed["clean"]) as a, weights(cut) as c:
        names = []
        a.visititems(lambda name, x: names.append(name) if isinstance(x, h5py.Dataset) else None)
        assert names and all((a[n][()] == c[n][()]).all() for n in names)


# ---------------------------------------------------------------------------
# RL: each rollout's queries cut to the bucket of its batch's longest prompt (grpo.py; rloo.py and
# ppo.py share its rollout)
# ---------------------------------------------------------------------------
def long_tail_prompts(path):
    """Six prompts: four short toy ones from the bundled file and two long ones (~50 and ~100 tokens), so
    in 3 steps of 2 prompts at least one batch is all short and at least one holds a long prompt."""
    with open(os.path.join(ROOT, "data", "prompts_train.jsonl")) as f:
        rows = [json.loads(line) for line in f][:4]
    rng = np.random.default_rng(0)
    for k in (24, 48):
        digits = rng.integers(0, 10, k)
        rows.append(
            {
                "prompt": "Sort: " + " ".join(map(str, digits)),
                "answer": " " + " ".join(map(str, sorted(digits))),
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [r["prompt"] for r in rows]


RL_FLAGS = [
    "--model",
    "tiny",
    "--max-steps",
    "3",
    "--save-every",
    "1",
    "--batch-size",
    "8",
    "--num-generations",
    "4",
    "--response-length",
    "8",
    "--max-prompt-length",
    "128",
    "--learning-rate",
    "3e-4",
    "--beta",
    "0.04",
    "--sample-every",
    "0",
    "--seed",
    "2",
]


def test_grpo_rollouts_cut_to_their_bucket_compile_per_bucket_and_resume_exactly(tmp_path):
    import keras_hub
    import grpo

    prompts = long_tail_prompts(tmp_path / "prompts.jsonl")
    flags = [*RL_FLAGS, "--dataset", str(tmp_path / "prompts.jsonl")]
    res = run_script("grpo.py", *flags, "--output-dir", str(tmp_path / "clean"), env=one_device_env())
    assert res.returncode == 0, res.stderr[-3000:]
    # Each step's batch as main draws it: one permutation of the 6 prompts, 2 prompts (× G = 4) a step.
    tokenizer = keras_hub.models.GemmaTokenizer(proto=common.TINY_TOKENIZER)
    queries, query_mask = grpo.tokenize_prompts(prompts, tokenizer, 128)
    order = np.random.default_rng(2).permutation(len(prompts))
    batches = [np.repeat(order[2 * s : 2 * s + 2], 4) for s in range(3)]
    buckets = [common.bucket_length(query_mask[idx].sum(1).max(), queries.shape[1]) for idx in batches]
    assert queries.shape[1] > 32 and len(set(buckets)) >= 2, buckets  # the batches really differ in width
    rows = metrics(tmp_path / "clean")
    assert [r["charts/query_padding_fraction"] for r in rows] == pytest.approx(
        [1 - query_mask[idx].sum() / (8 * t) for idx, t in zip(batches, buckets)], abs=1e-12
    )
    # the sampler compiles once per bucket met so far, not once per step
    assert [r["charts/generate_compilations"] for r in rows] == [len(set(buckets[: s + 1])) for s in range(3)]
    # --resume from step 1's checkpoint replays steps 2 and 3 bit for bit, whatever their buckets
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "clean", cut)
    for leftover in (cut / "checkpoints" / "2", cut / "checkpoints" / "3", cut / "model"):
        shutil.rmtree(leftover)
    res = run_script("grpo.py", *flags, "--output-dir", str(cut), "--resume", env=one_device_env())
    assert res.returncode == 0 and "resumed from step 1" in res.stdout, res.stderr[-3000:]
    drop = ("charts/", "_time", "tokens_per_sec")
    strip = lambda rows: [{k: v for k, v in r.items() if not any(d in k for d in drop)} for r in rows]
    assert strip(metrics(cut)) == strip(rows)
    assert [r["charts/query_padding_fraction"] for r in metrics(cut)] == [
        r["charts/query_padding_fraction"] for r in rows
    ]


def test_a_batch_cut_to_its_bucket_samples_and_scores_as_at_the_full_width():
    """Left padding is masked and RoPE sees only distances, so the short prompts' rows at their bucket (32)
    give the tokens and log-probs they get left-padded to the run's width (128)."""
    import jax
    import jax.numpy as jnp
    import grpo

    model = common.load_model("tiny", common.make_mesh(None), "float32", seed=0)
    params, frozen = common.split_variables(model.backbone)
    tok = model.preprocessor.tokenizer
    short = ["Sort: 3 1 2", "Sort: 9 8 7 6 5 4", "Sort: 1", "Sort: 5 5 0 2"]
    queries, query_mask = grpo.tokenize_prompts(short + ["Sort: " + " 7" * 100], tok, 128)
    # [8, 128]: the short ones (twice: a row per simulated device), padded to the long one's 128
    queries, query_mask = np.tile(queries[:4], (2, 1)), np.tile(query_mask[:4], (2, 1))
    eos, pad, r = tok.end_token_id, tok.pad_token_id, 16
    on_data = jax.sharding.NamedSharding(common.make_mesh(None), jax.sharding.PartitionSpec("data"))
    gen = jax.jit(
        functools.partial(
            grpo.generate, model.backbone, response_length=r, temperature=1.0, stop_ids=eos, pad_id=pad
        )
    )
    full = grpo.rollout(
        gen,
        params,
        frozen,
        queries,
        query_mask,
        key=jax.random.key(0),
        stop_ids=eos,
        pad_id=pad,
        on_data=on_data,
    )[0]
    assert queries.shape[1] == 128 and common.query_length(full) == 32  # rollout cut the batch to its bucket
    full = jax.device_get(full)  # on the host: the reference below runs on the same (unsharded) inputs
    # the unbucketed reference: the same batch at the full width, through the sampler directly
    tokens = gen(params, frozen, jnp.asarray(queries), jnp.asarray(query_mask), jax.random.key(0))[0]
    responses = np.asarray(grpo.truncate_response(tokens, eos, pad)[0])  # [8, R]
    np.testing.assert_array_equal(full["query_responses"][:, 32:], responses)

    @functools.partial(jax.jit, static_argnums=2)
    def logps(ids, mask, q):  # [B, R] at the query width q
        return grpo.response_logps(
            model.backbone, params, frozen, ids, mask, context_length=q, temperature=1.0
        )[0]

    wide_mask = np.concatenate([query_mask, full["response_mask"]], 1)
    wide = logps(np.concatenate([queries, responses], 1), wide_mask, 128)  # [8, R], Q = 128
    np.testing.assert_allclose(
        np.asarray(logps(full["query_responses"], full["padding_mask"], 32)), np.asarray(wide), atol=1e-5
    )
