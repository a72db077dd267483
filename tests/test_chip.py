"""What a real accelerator needs, checked on CPU: a lone host starts alone whatever its launcher variables
(a one-host TPU VM sets TPU_WORKER_HOSTNAMES=localhost; tests/test_lifecycle.py runs sft.py so), several
hosts start jax.distributed, a failed start is one line (exit 2); --remat auto survives a compile that runs
out of memory and, where nothing fits, says which flags to change; frozen weights are held in the compute
dtype."""

import functools
import json
import os

import numpy as np
import pytest

import common  # first: KERAS_BACKEND=jax
import jax
import jax.numpy as jnp
import tpu_kernels
import plumbing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def initialize(monkeypatch):
    """jax.distributed.initialize replaced by a recorder of its calls; no launcher variable set."""
    calls = []
    for name in common.CLUSTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a: calls.append(a))
    return calls


@pytest.mark.parametrize(
    "variables",
    [{}, {"TPU_WORKER_HOSTNAMES": "localhost"}, {"SLURM_NTASKS": "1"}, {"OMPI_COMM_WORLD_SIZE": "1"}],
)
def test_a_lone_host_starts_alone(initialize, monkeypatch, variables):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    common.init_distributed()
    assert initialize == []


@pytest.mark.parametrize(
    "variables, size",
    [
        ({"TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3"}, 2),
        ({"SLURM_NTASKS": "4"}, 4),
        ({"OMPI_COMM_WORLD_SIZE": "8"}, 8),
    ],
)
def test_several_hosts_start_jax_distributed(initialize, monkeypatch, variables, size):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert common.cluster_size() == (size, next(iter(variables)))
    common.init_distributed()
    assert initialize == [(None, None, None)]  # JAX finds the coordinator and the process's index itself


def test_the_flags_start_it_on_any_host(initialize, monkeypatch):
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")
    common.init_distributed("10.0.0.2:1234", 2, 1)
    assert initialize == [("10.0.0.2:1234", 2, 1)]


def test_a_failed_start_is_one_line_naming_what_was_tried(monkeypatch):
    def refuse(*a):
        raise ConnectionError("Failed to connect to the metadata server\nretrying ...\nmore")

    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "host-a,host-b")
    monkeypatch.setattr(jax.distributed, "initialize", refuse)
    with pytest.raises(plumbing.UsageError) as e:
        common.init_distributed()
    message = str(e.value)
    assert "\n" not in message
    assert "TPU_WORKER_HOSTNAMES='host-a,host-b' (2 processes" in message
    assert "ConnectionError: Failed to connect to the metadata server;" in message
    assert "--coordinator-address HOST:PORT --num-processes N --process-id I" in message


GIB = 2**30
OOM = "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 24.26G of 15.75G hbm. Exceeded hbm capacity by 8.51G.\nTotal hbm usage >= 24.26G:\n    reserved 1M\n    program 24.26G"


def peaks(table):
    """peak_of for choose_remat from {mode: GiB, or OOM: the compile raises as XLA:TPU does}."""

    def peak_of(mode):
        if table[mode] == "OOM":
            raise RuntimeError(OOM)
        return table[mode] * GIB

    return peak_of


def test_auto_takes_the_first_policy_that_fits():
    limit = 16 * GIB  # 90% of it: 14.4 GiB
    assert plumbing.choose_remat(peaks({"off": 9.0}), limit)[0] == "off"
    mode, why = plumbing.choose_remat(peaks({"off": 15.0, "off/2": 14.8, "save_dots": 14.0}), limit)
    assert mode == "save_dots" and "off 15.00 GiB, off/2 14.80 GiB, save_dots 14.00 GiB" in why
    # the no-remat compile runs out of memory itself (a TPU's compiler refuses, it reports no peak)
    table = {"off": "OOM", "off/2": "OOM", "save_dots": "OOM", "minimal": 12.0}
    mode, why = plumbing.choose_remat(peaks(table), limit)
    assert mode == "minimal" and "off: does not compile in the memory (RESOURCE_EXHAUSTED" in why


def test_auto_says_which_flags_to_change_when_nothing_fits():
    table = {"off": "OOM", "off/2": "OOM", "save_dots": "OOM", "minimal": "OOM", "full": 20.0}
    with pytest.raises(plumbing.UsageError) as e:
        plumbing.choose_remat(peaks(table), 16 * GIB)
    message = str(e.value)
    assert "\n" not in message and "full 20.00 GiB" in message and "16.00 GiB" in message
    for lever in ("--batch-size", "--grad-accum-steps", "--max-length", "--lora-rank", "--mesh"):
        assert lever in message


def test_auto_halves_the_micro_batches_before_it_recomputes():
    """Where a script's accumulation is exact (Remat.jit's split), "off/2" (nothing recomputed, each micro-batch
    run as two halves) comes before every recomputing policy; elsewhere it is not tried."""
    limit = 16 * GIB
    assert plumbing.AUTO_ORDER.index("off/2") < plumbing.AUTO_ORDER.index("save_dots")
    mode, why = plumbing.choose_remat(peaks({"off": "OOM", "off/2": 12.0}), limit)
    assert mode == "off/2" and "off/2 12.00 GiB" in why


def test_halved_micro_batches_give_the_same_update_and_move_no_data():
    """plumbing.halve_batch on sft.train_step over 8 devices: [A, B] micro-batches run as [2A, B/2] give the same
    loss, gradient norm and weights (equal micro-batches, a token sum over the whole batch), and each half is
    every device's own first or second half of its rows: the halving compiles without a collective."""
    import types

    import optax
    import sft

    mesh = common.make_mesh("data=8")
    backbone = common.load_model("tiny", mesh, "float32", seed=0).backbone
    params, frozen = common.split_variables(backbone)
    optimizer = optax.sgd(1.0)  # the new weights: the old minus the gradient
    state = (params, optimizer.init(params))
    rng = np.random.default_rng(0)
    loss_mask = rng.random((1, 16, 12)) < 0.7
    batch = {"token_ids": rng.integers(3, 300, (1, 16, 12)).astype(np.int32), "loss_mask": loss_mask}
    batch["padding_mask"] = np.ones((1, 16, 12), bool)
    batch = common.shard_batch(mesh, batch)  # [A = 1, B = 16] over 8 devices: 2 rows each
    step = functools.partial(sft.train_step, backbone, optimizer, types.SimpleNamespace(skip_nonfinite=False))
    whole = jax.jit(step)(state, frozen, batch)
    halved = jax.jit(functools.partial(plumbing.halve_batch, step, 2, 8))(state, frozen, batch)
    for key in ("train/loss", "train/grad_norm", "train/num_loss_tokens"):
        np.testing.assert_allclose(halved[1][key], whole[1][key], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(halved[0]), jax.tree.leaves(whole[0]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    ids = batch["token_ids"]
    split = jax.jit(lambda b: plumbing.halve_batch(lambda x: x, 0, 8, b))
    np.testing.assert_array_equal(split(ids)[0], np.asarray(ids)[0, 0::2])  # each device's first row
    np.testing.assert_array_equal(split(ids)[1], np.asarray(ids)[0, 1::2])
    hlo = split.lower(ids).compile().as_text()
    assert not any(op in hlo for op in ("all-to-all", "all-gather", "collective-permute", "all-reduce"))


def test_auto_compiles_every_policy_at_once_takes_the_first_that_fits_and_remembers_it(monkeypatch, tmp_path):
    """Remat.choose compiles each policy of AUTO_ORDER (in threads, started as each trace ends) and takes the
    first in that order whose peak fits 90%, as compiling them in turn did; the decision is stored beside the
    compilation cache, and the next run of the same step (a new Remat, as a rerun or --resume makes) compiles
    that one policy alone and says so. A step whose memory grows as its policy keeps more (a stand-in switch:
    no model) shows it: off and save_dots are over, minimal fits. The step's first call runs the compiled
    program itself: no second trace. A remembered policy whose compile now runs out of memory (a stale
    entry: off, the compile raising as XLA:TPU does) is decided afresh, not raised."""
    import types

    import blocks

    monkeypatch.setattr(blocks, "remembered", functools.partial(blocks.remembered, folder=str(tmp_path)))
    compiled, traces, ran_out = [], [], []
    real = jax.stages.Lowered.compile
    monkeypatch.setattr(jax.stages.Lowered, "compile", lambda self: compiled.append(1) or real(self))
    switch = types.SimpleNamespace()  # what enable_remat sets on a backbone: remat_mode, read while tracing
    kept = {"off": 4096, "save_dots": 2048, "minimal": 1024, "full": 512}  # rows of a [n, 1024] f32 buffer

    def out_of_memory_once(self):  # the first compile after it is set (the remembered off) runs out of memory
        if not ran_out:
            ran_out.append(1)
            raise RuntimeError(OOM)
        compiled.append(1)
        return real(self)

    def step(state, frozen, batch):
        traces.append(switch.remat_mode)
        n = kept[switch.remat_mode]
        buffer = jnp.cumsum(jnp.broadcast_to(batch.sum() + state, (n, 1024)), axis=0)  # made, not folded
        return state + buffer.sum(), frozen

    args = (jnp.float32(0), jnp.float32(1), jnp.ones((1, 4, 8)))
    limit = 12 * 2**20 / 0.9  # a 4 MiB buffer fits 90% of it, an 8 MiB one does not
    for run in ("first", "again", "stale"):
        if run == "stale":
            stored = tmp_path / "remat-auto.json"
            stored.write_text(json.dumps(dict.fromkeys(json.loads(stored.read_text()), "off")))
            monkeypatch.setattr(jax.stages.Lowered, "compile", out_of_memory_once)
        compiled.clear()
        remat = blocks.Remat("auto", switch, limit=limit, say=lambda line, run=run: said.update({run: line}))
        said = {} if run == "first" else said
        fn = remat.jit(step)
        traces.clear()
        out = fn(*args)
        assert str(remat) == "minimal" and float(out[0]) > 0
        assert traces.count("minimal") == 1, traces  # traced for its compile, not again for the call
        # every policy up to the chosen one compiled; the one after it (full) may be cancelled unstarted once
        # minimal is taken (a busy machine's thread pool had not begun it: 3 compiles, not 4)
        assert len(compiled) in {"first": (3, 4), "again": (1,), "stale": (3, 4)}[run], (run, compiled)
    assert "remat: auto -> minimal (compiled peak per device: off " in said["first"]
    assert "as decided here before" in said["again"] and "--remat minimal" in said["again"]
    assert "as decided here before" not in said["stale"]
    assert list(json.load(open(tmp_path / "remat-auto.json")).values()) == ["minimal"]


def test_auto_lets_other_errors_through():
    def broken(mode):
        raise ValueError("a bug, not memory")

    with pytest.raises(ValueError):
        plumbing.choose_remat(broken, 16 * GIB)


# ---------------------------------------------------------------------------
# Log-probs a chunk of positions at a time (common.per_token): equal to the whole logits' to rounding
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    mesh = common.make_mesh()
    model = common.load_model("tiny", mesh, "float32", seed=0)
    params, frozen = common.split_variables(model.backbone)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 300, (4, 23)).astype(np.int32)
    mask = np.ones_like(ids, bool)
    mask[1, 15:] = False  # a right-padded row
    return model.backbone, params, frozen, ids, mask


def chunked_and_whole(backbone, fn, monkeypatch):
    """fn's value and gradient (a fixed random weighting of its outputs, d/d params) at --logits-chunk 5
    (T not a multiple: the last chunk is padded) and 0 (the whole logits, no chunks)."""
    out = {}
    for chunk in (5, 0):
        monkeypatch.setattr(backbone, "logits_chunk", chunk, raising=False)
        out[chunk] = jax.jit(jax.value_and_grad(fn, has_aux=True))  # traced afresh: the chunk is read then
    return out


def weighting(x):
    return jnp.asarray(np.random.default_rng(1).normal(size=x.shape), x.dtype)


def test_sft_log_probs_by_chunks_equal_the_whole_logits(tiny, monkeypatch):
    import sft

    backbone, params, frozen, ids, mask = tiny

    def fn(p):
        logps = sft.token_logps(backbone, p, frozen, ids, mask)[0]  # [B, T-1]
        return jnp.sum(weighting(logps) * jnp.where(mask[:, 1:], logps, 0.0)), logps

    fns = chunked_and_whole(backbone, fn, monkeypatch)
    (_, chunked), g_chunked = fns[5](params)
    (_, whole), g_whole = fns[0](params)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g_chunked), jax.tree.leaves(g_whole)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_rl_log_probs_and_entropy_by_chunks_equal_the_whole_logits(tiny, monkeypatch):
    """grpo.py's response_logps (ppo's and rloo's are the same copy) under TRL's filters: log q of the
    response tokens and q's entropy, values and gradients, against the whole [B, R, V] logits."""
    import grpo

    backbone, params, frozen, ids, _ = tiny
    mask = np.ones_like(ids, bool)

    def fn(p):
        logq, entropy, _ = grpo.response_logps(
            backbone, p, frozen, ids, mask, context_length=6, temperature=0.7, top_k=50, top_p=0.9, min_p=None
        )
        return jnp.sum(weighting(logq) * logq + 0.1 * entropy), (logq, entropy)

    fns = chunked_and_whole(backbone, fn, monkeypatch)
    (_, chunked), g_chunked = fns[5](params)
    (_, whole), g_whole = fns[0](params)
    for a, b in zip(chunked, whole):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g_chunked), jax.tree.leaves(g_whole)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_distill_divergence_by_chunks_equals_the_whole_logits(tiny, monkeypatch):
    """distill.py's completion_divergence (a teacher of the same tiny architecture, other weights)."""
    import distill

    backbone, params, frozen, ids, _ = tiny
    mesh = common.make_mesh()
    teacher = common.load_model("tiny", mesh, "float32", seed=1).backbone
    teacher_weights = common.split_variables(teacher)
    response_mask = np.ones((ids.shape[0], ids.shape[1] - 6), bool)
    response_mask[2, 9:] = False

    def fn(p):
        divergence, logq, entropy, _ = distill.completion_divergence(
            backbone,
            p,
            frozen,
            teacher,
            teacher_weights,
            token_ids=ids,
            padding_mask=np.ones_like(ids, bool),
            response_mask=response_mask,
            context_length=6,
            beta=0.5,
            temperature=1.0,
        )
        return jnp.sum(weighting(divergence) * divergence), (divergence, logq, entropy)

    fns = chunked_and_whole(backbone, fn, monkeypatch)
    (_, chunked), g_chunked = fns[5](params)
    (_, whole), g_whole = fns[0](params)
    for a, b in zip(chunked, whole):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g_chunked), jax.tree.leaves(g_whole)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# Frozen weights in the compute dtype (split_variables' frozen_dtype)
# ---------------------------------------------------------------------------
def test_float32_runs_are_unchanged_by_the_weights_scope(tiny):
    """In float32 nothing is recast: the project's scope gives the very values keras.StatelessScope gives."""
    import keras

    backbone, params, frozen, ids, mask = tiny

    def old(p):
        state = zip(backbone.trainable_variables + backbone.non_trainable_variables, p + frozen)
        with keras.StatelessScope(state_mapping=state):
            return backbone(common.inputs(backbone, ids, mask))

    def new(p):
        with common.weights(backbone, p, frozen):
            return backbone(common.inputs(backbone, ids, mask))

    np.testing.assert_array_equal(np.asarray(jax.jit(old)(params)), np.asarray(jax.jit(new)(params)))


def test_lora_base_held_in_bfloat16_halves_it_and_keeps_the_values():
    """LoRA at bfloat16 compute: the frozen base held in bfloat16 takes half the bytes, every trainable
    LoRA factor stays float32, and the log-probs equal those of the float32-held base to bfloat16 rounding
    (the mixed policy casts every weight to bfloat16 as a layer reads it anyway)."""
    import sft

    mesh = common.make_mesh()
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 300, (4, 16)).astype(np.int32)
    mask = np.ones_like(ids, bool)
    out = {}
    for held in ("float32", "bfloat16"):
        backbone = common.load_model("tiny", mesh, "bfloat16", seed=0, lora_rank=4).backbone
        params, frozen = common.split_variables(backbone, frozen_dtype=held)
        nbytes = sum(x.size * x.dtype.itemsize for x in frozen)
        assert all(x.dtype == jnp.float32 for x in params)  # the trained factors keep their master copy
        assert {str(x.dtype) for x in frozen} == {held}
        assert all(v.value.dtype == held for v in backbone.non_trainable_variables)  # the buffers replaced
        logps = jax.jit(lambda p: sft.token_logps(backbone, p, frozen, ids, mask)[0])(params)
        out[held] = nbytes, np.asarray(logps, np.float32)
    assert out["bfloat16"][0] * 2 == out["float32"][0]
    np.testing.assert_allclose(out["bfloat16"][1], out["float32"][1], rtol=0.02, atol=0.02)


def test_a_model_trained_in_bfloat16_saves_a_preset_keras_hub_reads_back(tmp_path):
    """On a TPU or GPU every run computes in bfloat16, and keras-hub's from_preset could not read back the
    mixed_bfloat16 policy it saved (interop.plain_saved_dtype): a LoRA model with its base held in bfloat16
    saves a preset that CausalLM.from_preset loads, with every weight the one held (LoRA's B is 0 at start:
    the merged kernel is the base)."""
    import keras_hub

    model = common.load_model("tiny", common.make_mesh(), "bfloat16", seed=0, lora_rank=4)
    params, frozen = common.split_variables(model.backbone, frozen_dtype="bfloat16")
    held = {v.path: np.asarray(v.value, np.float32) for v in model.backbone.non_trainable_variables}
    common.save_model(model, params, str(tmp_path))
    loaded = keras_hub.models.CausalLM.from_preset(str(tmp_path))
    assert loaded.backbone.dtype_policy.name == "float32"  # the loader chooses the compute dtype
    weights = {v.path: np.asarray(v.value) for v in loaded.backbone.weights}
    assert set(held) <= set(weights)
    for path, value in held.items():
        np.testing.assert_array_equal(weights[path], value)


def test_label_logp_and_its_gradient_by_hand_and_against_autodiff():
    """common.label_logp (log softmax(z)[y], its backward written out): by hand on two positions, then on
    random logits against a float64 NumPy re-derivation (value z_y − log Σ exp z, gradient g·(onehot − p))
    and against autodiff of take_along_axis − logsumexp: values equal bit for bit in float32, gradients to
    float32 rounding; bf16 logits get a bf16 gradient, their float32 one rounded."""
    z = jnp.asarray([[0.0, 0.0, np.log(2.0)], [1.0, 1.0, 1.0]], jnp.float32)  # softmax 1/4, 1/4, 1/2; thirds
    y = jnp.asarray([2, 0])
    logp, grad = jax.value_and_grad(lambda z: (common.label_logp(z, y) * jnp.asarray([1.0, 3.0])).sum())(z)
    np.testing.assert_allclose(logp, np.log(0.5) + 3 * np.log(1 / 3), rtol=1e-6)
    np.testing.assert_allclose(grad, [[-0.25, -0.25, 0.5], [2.0, -1.0, -1.0]], atol=1e-6)  # g·(onehot − p)

    rng = np.random.default_rng(0)
    z = rng.normal(size=(3, 5, 50)).astype(np.float32) * 4
    y = rng.integers(0, 50, size=(3, 5))
    g = rng.normal(size=(3, 5)).astype(np.float32)
    z64 = z.astype(np.float64)
    lse64 = np.log(np.exp(z64).sum(-1))
    want = np.take_along_axis(z64, y[..., None], -1)[..., 0] - lse64
    want_grad = g[..., None] * (np.eye(50)[y] - np.exp(z64 - lse64[..., None]))
    mine = jax.value_and_grad(lambda z: (common.label_logp(z, y) * g).sum())
    autodiff = jax.value_and_grad(
        lambda z: ((jnp.take_along_axis(z, y[..., None], -1)[..., 0] - jax.nn.logsumexp(z, -1)) * g).sum()
    )
    (value, grad), (value_ad, grad_ad) = mine(jnp.asarray(z)), autodiff(jnp.asarray(z))
    np.testing.assert_array_equal(
        common.label_logp(jnp.asarray(z), y),
        jnp.take_along_axis(jnp.asarray(z), y[..., None], -1)[..., 0] - jax.nn.logsumexp(jnp.asarray(z), -1),
    )
    np.testing.assert_allclose(common.label_logp(jnp.asarray(z), y), want, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(grad, want_grad, atol=1e-6)
    np.testing.assert_allclose(grad, grad_ad, atol=1e-6)
    zb = jnp.asarray(z, jnp.bfloat16)
    grad_b = jax.grad(lambda z: (common.label_logp(z, y) * g).sum())(zb)
    assert grad_b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        grad_b,
        jax.grad(lambda z: (common.label_logp(z, y) * g).sum())(zb.astype(jnp.float32)).astype(jnp.bfloat16),
    )


def test_the_default_chunks_only_logits_that_would_be_large():
    """--logits-chunk None (the default): the whole [B, T, V] where its float32 logits take at most 1 GiB
    (one call, no scan), else 1,024 tokens of the batch a chunk, 1024 // B positions of each row (a scan over
    ceil(T / C) chunks); a number is taken as given."""
    import re
    import types

    def chunks(vocabulary, b, t, chunk=None):  # the scan's length; 0: no scan
        backbone = types.SimpleNamespace(vocabulary_size=vocabulary, logits_chunk=chunk)
        hidden = jax.ShapeDtypeStruct((b, t, 8), jnp.float32)
        jaxpr = str(
            jax.make_jaxpr(lambda h: common.per_token(backbone, lambda x: (x.sum(-1),), (h,)))(hidden)
        )
        lengths = re.findall(r"scan\[.*?length=(\d+)", jaxpr, re.S)
        return int(lengths[0]) if lengths else 0

    assert chunks(320, 32, 512) == 0  # tiny: 21 MB
    assert chunks(256_000, 1, 1024) == 0  # 4 × 1 × 1024 × 256,000 bytes = 0.98 GiB: whole
    assert chunks(256_000, 2, 1024) == 2  # 1.95 GiB: 512 positions a chunk
    assert chunks(256_000, 4, 1024) == 4  # 256 positions (one v5e's LoRA row, 4 × 1024)
    assert chunks(256_000, 64, 1024) == 64  # 16 positions (a v5e-8's batch of 64, the vocabulary sharded)
    assert chunks(256_000, 32, 500) == 16  # 32 positions, the last chunk padded (500 = 15 × 32 + 20)
    assert chunks(256_000, 2048, 16) == 16  # at least one position
    assert chunks(320, 32, 512, chunk=64) == 8 and chunks(256_000, 2, 1024, chunk=0) == 0


@pytest.mark.parametrize("gemma2", [False, True], ids=["gemma", "gemma2-softcap-window"])
def test_splash_attention_equals_keras_hubs_at_every_real_position(gemma2):
    """tpu_kernels.flash_attention on a data=2, model=4 mesh (the kernel in Pallas' interpreter, 128-position blocks):
    the hidden states at every real position and the gradient of every weight equal KerasHub's attention,
    with left padding, right padding and a hole mid-row; Gemma 2's attention soft cap and a 40-position
    sliding window go into the kernel. A single block keeps KerasHub's attention."""
    mesh = common.make_mesh("data=2,model=4")  # the suite's 8 devices; one KV head: heads whole on `model`
    with common.distribution_for(mesh, common.keras_hub.models.GemmaBackbone).scope():
        backbone = common.keras_hub.models.GemmaBackbone(
            vocabulary_size=64,
            num_layers=2,
            num_query_heads=4,
            num_key_value_heads=1,
            hidden_dim=64,
            intermediate_dim=128,
            head_dim=32,
            attention_logit_soft_cap=50.0 if gemma2 else None,
            use_sliding_window_attention=gemma2,
            sliding_window_size=40,
            dtype="float32",
        )
    params, frozen = common.split_variables(backbone)
    ids = np.random.default_rng(0).integers(1, 64, (4, 256)).astype("int32")
    mask = np.ones((4, 256), bool)
    mask[0, :30] = mask[1, 200:] = mask[2, 50:60] = False  # left padding, right padding, a hole

    def loss(params, ids, mask):
        hidden, _ = common.forward(backbone, params, frozen, ids, mask)
        return (hidden * mask[..., None] * np.linspace(-1, 1, 64)).sum(), hidden

    (_, keras_hidden), keras_grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, ids, mask)
    tpu_kernels.flash_attention(backbone, mesh, interpret=True, block=128)
    assert "pallas_call" in str(jax.make_jaxpr(loss)(params, ids, mask))
    assert "pallas_call" not in str(jax.make_jaxpr(loss)(params, ids[:, :128], mask[:, :128]))
    q, kv = (jax.ShapeDtypeStruct((4, 256, h, 32), jnp.bfloat16) for h in (4, 1))
    attend = backbone.transformer_layers[0].attention._compute_attention
    out = jax.eval_shape(lambda q, k, v: attend(q, k, v, jnp.ones((4, 256, 256), bool)), q, kv, kv)
    assert out.dtype == jnp.bfloat16  # q scaled in its own dtype (a float64 scale made it float32)
    (_, hidden), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, ids, mask)  # traced anew
    np.testing.assert_allclose(
        np.where(mask[..., None], hidden, 0), np.where(mask[..., None], keras_hidden, 0), atol=2e-5
    )
    for g, keras_g in zip(grads, keras_grads, strict=True):
        np.testing.assert_allclose(g, keras_g, rtol=1e-4, atol=1e-4 * np.abs(keras_g).max())
