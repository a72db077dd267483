"""sft.py --packing (blocks.pack, blocks.packed): examples share rows of --max-length, best fit, and each token
keeps the log-prob it has alone; the loss is the same token mean; a packed step spread over 8 devices is one
device's; a packed run learns. Per family (Gemma 1-4, Llama 3, Mistral, Qwen 2.5/3; Qwen 3.5 refused):
tests/test_families.py."""

import json
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_device_mesh():
    import jax

    return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))


def examples_of(lengths, seed=0):
    """(ids, loss mask) examples of these lengths: BOS-like first token never in the loss, the rest random."""
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(3, 300, n).astype(np.int32), np.arange(n) >= rng.integers(1, max(n, 2)))
        for n in lengths
    ]


def test_pack_is_best_fit_decreasing_by_hand():
    """Lengths 5, 4, 3, 3, 2, 1 into rows of 8, by hand: 5 opens row A (room 3), 4 opens B (4), the first 3
    fills A (0), the second goes to B (1: the only room), 2 opens C (6), 1 goes to B, the fullest that holds
    it (0), not C. No example is cut; segment ids count each row's examples from 1."""
    import blocks

    examples = examples_of([3, 5, 1, 4, 3, 2])
    rows = blocks.pack(examples, 8)
    assert [list(np.bincount(seg)[1:]) for _, _, seg in rows] == [[5, 3], [4, 3, 1], [2]]
    for ids, mask, seg in rows:
        assert len(ids) == len(mask) == len(seg) <= 8
    placed = sorted(tuple(ids[seg == s]) for ids, _, seg in rows for s in range(1, seg.max() + 1))
    assert placed == sorted(tuple(ids) for ids, _ in examples)


@pytest.fixture(scope="module")
def tiny():
    import common

    model = common.load_model("tiny", one_device_mesh(), "float32", seed=0)
    return model.backbone, *common.split_variables(model.backbone)


def test_packed_rows_give_each_token_its_log_prob_alone_and_the_same_loss(tiny):
    """Six examples (lengths 3 … 21) right-padded one a row, and packed into rows of 32: every token's
    log-prob equal (the attention stops at each example's end, the positions restart), and sft.compute_loss
    over each batch, ÷ the same loss-token count, equal: the loss is the token mean either way. The boundary
    between two examples is never scored (the next example's BOS is no loss token). Without the segments the
    second example of a row scores differently (the check can fail)."""
    import blocks
    import sft

    backbone, params, frozen = tiny
    examples = examples_of([21, 3, 12, 8, 17, 5])
    rows = blocks.pack(examples, 32)
    alone, packed = sft.pad_examples(examples, 24), sft.pad_examples(rows, 32)
    assert len(rows) < len(examples) and packed["padding_mask"].dtype == np.int32
    logps_alone = np.asarray(
        sft.token_logps(backbone, params, frozen, alone["token_ids"], alone["padding_mask"])[0]
    )
    logps_packed = np.asarray(
        sft.token_logps(backbone, params, frozen, packed["token_ids"], packed["padding_mask"])[0]
    )
    crossed = np.asarray(
        sft.token_logps(backbone, params, frozen, packed["token_ids"], packed["padding_mask"] > 0)[0]
    )
    differs = 0
    for r, (ids, _, seg) in enumerate(rows):
        for s in range(1, seg.max() + 1):
            at = np.flatnonzero(seg == s)
            i = next(i for i, (x, _) in enumerate(examples) if len(x) == len(at) and (x == ids[at]).all())
            got = logps_packed[r, at[0] : at[-1]]  # position t scores token t + 1, within the example
            np.testing.assert_allclose(got, logps_alone[i, : len(at) - 1], rtol=1e-5, atol=2e-5)
            differs += s > 1 and not np.allclose(crossed[r, at[0] : at[-1]], got, atol=1e-3)
    assert differs > 0
    n = alone["loss_mask"][:, 1:].sum()
    assert packed["loss_mask"][:, 1:].sum() == n
    batch = lambda d: {k: d[k] for k in ("token_ids", "padding_mask", "loss_mask")}  # noqa: E731
    loss_alone = sft.compute_loss(backbone, params, frozen, batch(alone), n)[0]
    loss_packed = sft.compute_loss(backbone, params, frozen, batch(packed), n)[0]
    np.testing.assert_allclose(float(loss_packed), float(loss_alone), rtol=1e-6)


def test_a_packed_step_on_8_devices_is_one_devices():
    """sft.train_step on 8 packed rows: data=8 (one row a device) gives one device's loss, gradient norm and
    weights."""
    import types

    import common
    import jax
    import optax
    import sft

    examples = examples_of(list(np.random.default_rng(1).integers(3, 30, 40)), seed=1)
    rows = sft.pad_examples(__import__("blocks").pack(examples, 64)[:8], 64)
    batch = {k: v[None] for k, v in rows.items()}  # [A = 1, 8, 64]
    out = {}
    for spec in ("data=1", "data=8"):
        mesh = common.make_mesh(spec) if spec == "data=8" else one_device_mesh()
        backbone = common.load_model("tiny", mesh, "float32", seed=0).backbone
        params, frozen = common.split_variables(backbone)
        optimizer = optax.sgd(1.0)
        state = (params, optimizer.init(params))
        step = jax.jit(
            lambda s, f, b, backbone=backbone, optimizer=optimizer: sft.train_step(
                backbone, optimizer, types.SimpleNamespace(skip_nonfinite=False), s, f, b
            )
        )
        out[spec] = jax.device_get(step(state, frozen, common.shard_batch(mesh, batch)))
    for key in ("train/loss", "train/grad_norm", "train/num_loss_tokens"):
        np.testing.assert_allclose(out["data=8"][1][key], out["data=1"][1][key], rtol=2e-5)
    for a, b in zip(jax.tree.leaves(out["data=8"][0][0]), jax.tree.leaves(out["data=1"][0][0]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_sft_packing_learns_and_says_how_it_packed(tmp_path, capsys):
    """sft.py --packing on the bundled data's first 1,000 rows: the rows are packed (said in the data line),
    --num-epochs counts packed rows, and the held-out loss falls."""
    import plumbing
    import sft

    out, data = tmp_path / "run", tmp_path / "train.jsonl"
    data.write_text("".join(open(os.path.join(ROOT, "data", "sft_train.jsonl")).readlines()[:1000]))
    (tmp_path / "eval.jsonl").write_text(open(os.path.join(ROOT, "data", "sft_eval.jsonl")).read())
    sft.main(
        plumbing.cli(
            sft.Args,
            [
                *("--model", "tiny", "--dataset", str(data), "--packing", "--max-length", "256"),
                *("--eval-dataset", str(tmp_path / "eval.jsonl"), "--batch-size", "8"),
                *("--num-epochs", "1", "--learning-rate", "1e-3", "--warmup-steps", "2"),
                *("--eval-every", "1000", "--num-samples", "0", "--output-dir", str(out)),
            ],
        )
    )
    said = capsys.readouterr().out
    rows = int(said.split("packed into ")[1].split()[0])
    n_examples = int(said.split("data: ")[1].split()[0])
    assert rows < n_examples / 4, said
    assert f"--max-steps {-(-rows // 8)}: 1 epochs of {rows} rows" in said
    evals = [json.loads(x)["eval/loss"] for x in open(out / "metrics.jsonl") if "eval/loss" in x]
    assert evals[-1] < evals[0] - 0.5, evals
