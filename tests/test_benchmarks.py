"""benchmarks/: throughput.py runs the scripts' own train_step and reports sane numbers;
memory.py compiles it with abstract weights and reports per-device bytes that follow the
sharding (full fine-tuning > LoRA; 8 shards of the weights, not 8 copies)."""

import contextlib
import functools
import io
import json
import os
import sys

import pytest

from helpers import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import memory  # noqa: E402  (benchmarks/ on the path; each script puts the repo root on it)
import throughput  # noqa: E402


def last_json(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sft_row():
    """One sft throughput run on tiny, shared by two tests (capsys is per test: capture by hand)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        throughput.main(
            throughput.Args(algo="sft", model="tiny", batch_size=8, max_length=32, steps=2, warmup=1)
        )
    return json.loads(buf.getvalue().strip().splitlines()[-1])


def test_throughput_sft_fields(sft_row):
    r = sft_row
    assert r["tokens_per_step"] == 8 * 32
    assert r["tokens_per_sec"] > 0 and r["step_time_s"] > 0
    assert r["tokens_per_sec"] == pytest.approx(r["tokens_per_step"] / r["step_time_s"])
    assert 0 < r["mfu"] <= 1
    n = 1611456  # tiny: every matmul weight incl. the tied embedding (plumbing.count_params)
    assert r["flops_per_token"] == 6 * n
    assert r["mfu"] == pytest.approx(r["tokens_per_sec"] * r["flops_per_token"] / r["peak_flops"])
    assert r["num_devices"] == 8 and r["device"] == "cpu"
    assert r["final_loss"] == r["final_loss"] and r["final_loss"] > 0  # not NaN
    assert r["timed_retraces"] == 0  # no timed step recompiles (counted: a warm-up from the cache is as fast)


def test_throughput_dpo_online_reference_counts_8n(sft_row, capsys):
    throughput.main(throughput.Args(algo="dpo", model="tiny", batch_size=8, max_length=32, steps=2, warmup=1))
    r = last_json(capsys)
    assert r["tokens_per_step"] == 2 * 8 * 32  # chosen + rejected
    assert r["flops_per_token"] * 6 == sft_row["flops_per_token"] * 8  # 8N vs 6N
    assert r["tokens_per_sec"] > 0 and 0 < r["mfu"] <= 1
    assert r["timed_retraces"] == 0


def test_throughput_bad_algo_exits_2():
    """An unknown --algo is bad input: through the CLI, tyro's choice check (one line, exit 2); in
    process, harness.import_algo's UsageError, which the CLI reports the same way. --help answers
    from the source (plumbing.answer_help), before the heavy imports."""
    import subprocess
    import plumbing

    script = os.path.join(ROOT, "benchmarks", "throughput.py")
    out = subprocess.run(
        [sys.executable, script, "--algo", "nope"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 2 and out.stderr.startswith("error: invalid choice 'nope'"), out.stderr[-500:]
    assert len(out.stderr.strip().splitlines()) == 1
    with pytest.raises(plumbing.UsageError, match="^--algo 'nope'"):
        throughput.main(throughput.Args(algo="nope"))
    out = subprocess.run(
        [sys.executable, "-X", "importtime", script, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        out.returncode == 0 and "--algo {sft,dpo,simpo,orpo,kto,reward,ppo,grpo,rloo,distill}" in out.stdout
    ), out.stderr[-500:]
    imported = {
        line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time")
    }
    assert "plumbing" in imported and not {"jax", "keras", "common", "harness"} & imported


def test_harness_table_and_script_args():
    """ALGOS: one entry per --algo; each script's Args at the benchmark's sizes; a size the script
    has no flag for is refused; memory.py has no flag that does nothing."""
    import typing
    import harness
    import plumbing

    assert list(harness.ALGOS) == list(typing.get_args(throughput.Args.__dataclass_fields__["algo"].type))
    sft, ppo = harness.import_algo("sft"), harness.import_algo("ppo")
    args = harness.script_args(sft, harness.Config("sft", batch_size=4, max_length=64, lora_rank=2))
    assert (args.batch_size, args.max_length, args.lora_rank, args.max_steps) == (4, 64, 2, harness.MAX_STEPS)
    with pytest.raises(plumbing.UsageError, match="sft.py has no --precompute-ref"):
        harness.script_args(sft, harness.Config("sft", precompute_ref=True))
    args = harness.script_args(ppo, memory.Args(algo="ppo", max_length=64))  # Config.of: the fields it has
    assert (args.max_prompt_length, args.response_length, args.num_mini_batches) == (32, 32, 2)
    assert not {"seed", "random_init", "steps"} & set(memory.Args.__dataclass_fields__)


def memory_row(**kw):
    """memory.py compiled for the CPU, float32 compute: the CPU compiler emulates bf16 through
    float32 copies of the weights (benchmarks/RESULTS.md), which would swamp `tiny`'s activations."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        memory.main(
            memory.Args(
                **{
                    **dict(
                        algo="sft",
                        model="tiny",
                        target="cpu",
                        mesh="data=4,model=2",
                        batch_size=8,
                        max_length=128,
                        dtype="float32",
                    ),
                    **kw,
                }
            )
        )
    return json.loads(buf.getvalue().strip().splitlines()[-1])


@pytest.fixture(scope="module")
def full_row():
    return memory_row(remat="off")


def test_memory_full_vs_lora_and_sharding(full_row):
    full, lora = full_row, memory_row(lora_rank=4, remat="off")
    # the step's arguments hold the weights and Adam's state; the peak holds the arguments and more
    assert (
        full["peak_bytes_per_device"]
        > full["argument_bytes"]
        >= full["trainable_bytes"] + full["optimizer_bytes"]
    )
    assert lora["peak_bytes_per_device"] < full["peak_bytes_per_device"]
    # float32 weights (whatever the compute dtype) of 1,611,456 params over 8 devices: about 1/8
    # each (norm scales are replicated).
    whole = 1611456 * 4
    assert whole / 8 <= full["trainable_bytes"] < whole / 6
    # Adam's mu and nu are laid out like the params (plus a replicated step count).
    assert full["optimizer_bytes"] == pytest.approx(2 * full["trainable_bytes"], abs=64)
    # LoRA: the base weights are frozen (no optimizer state for them), the trainable part is tiny.
    assert lora["trainable_bytes"] < full["trainable_bytes"] / 10
    assert lora["frozen_bytes"] >= full["trainable_bytes"]


def test_remat_decoder_blocks_cuts_memory(full_row):
    """--remat on (plumbing.enable_remat: per-block jax.checkpoint, "full") holds fewer temporaries than off
    in memory.py's compiled step; that it changes memory, not the math (full's step == off's), is checked
    in test_remat_policies_and_auto_resolve_by_compiled_memory."""
    assert memory_row(remat="on")["temp_bytes"] < full_row["temp_bytes"]


@pytest.mark.parametrize(
    "algo, batch, tokens, factor", [("grpo", 8, 8 * 16, 6), ("rloo", 8, 8 * 16, 6), ("ppo", 16, 8 * 16, 12)]
)  # ppo: one mini-batch of 8 a step
def test_throughput_rl_splits_an_iteration(capsys, algo, batch, tokens, factor):
    """--algo grpo / rloo: the script's train_step (6N, β = 0); --algo ppo: ppo.py's on one of 2 mini-batches
    (policy + value: 12N; 8 devices: 2 mini-batches of 8). Then whole iterations through the script's own sampler, scoring and
    advantages, timed per phase; generation speed counts the new tokens only."""
    throughput.main(
        throughput.Args(
            algo=algo,
            model="tiny",
            random_init=True,
            num_layers=1,
            batch_size=batch,
            max_length=16,
            steps=1,
            warmup=1,
            remat="off",
        )
    )
    r = last_json(capsys)
    assert r["tokens_per_step"] == tokens and r["flops_per_token"] % factor == 0
    assert r["flops_convention"].startswith(f"{factor}N, N={r['flops_per_token'] // factor} ")
    assert 0 < r["mfu"] <= 1
    assert r["iteration_s"] == pytest.approx(r["generate_s"] + r["score_s"] + r["update_s"])
    assert r["generate_tokens_per_sec"] == pytest.approx(batch * 8 / r["generate_s"])  # response = 16 / 2
    assert min(r["generate_s"], r["score_s"], r["update_s"]) > 0


def test_throughput_distill_times_the_student_update_with_the_teacher_forward(capsys):
    """--algo distill: distill.py's train_step, the 1-layer student's 6N and a 4-layer teacher's forward
    (2 N_T, counted in the student's N: between 4N and 8N, the embedding shared by neither)."""
    throughput.main(
        throughput.Args(
            algo="distill",
            model="tiny",
            teacher_model="tiny",
            random_init=True,
            num_layers=1,
            batch_size=8,
            max_length=16,
            steps=1,
            warmup=1,
            remat="off",
        )
    )
    r = last_json(capsys)
    assert r["tokens_per_step"] == 8 * 16 and r["final_loss"] > 0 and 0 < r["mfu"] <= 1
    factor = float(r["flops_convention"].split("N,")[0])
    assert 6 + 2 * 2 < factor < 6 + 2 * 4  # the 4-layer teacher over the 1-layer student (embedding shared)
    import plumbing

    with pytest.raises(plumbing.UsageError, match="needs --teacher-model"):
        throughput.main(throughput.Args(algo="distill", model="tiny", random_init=True, num_layers=1))


def test_longtail_modes(capsys):
    """longtail.py on tiny: the modes see the same stream (run_wide and buckets the same examples),
    run-wide pads every batch to the dataset's longest bucket and compiles once, buckets pad less; packed
    (sft.py --packing's rows) pads least, at --max-length, and carries more real tokens a step."""
    import longtail

    rows = longtail.main(
        longtail.Args(
            algo="sft",
            model="tiny",
            random_init=True,
            num_layers=1,
            lengths="lognormal:8,48",
            num_examples=64,
            min_length=4,
            batch_size=8,
            max_length=48,
            steps=2,
            remat="off",
            modes=("run_wide", "buckets", "grouped", "packed"),
        )
    )
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()[-4:]]
    wide, buckets, grouped, packed = rows
    assert [x["mode"] for x in lines] == ["run_wide", "buckets", "grouped", "packed"]
    assert packed["shapes"] == [48] and packed["padding_fraction"] < buckets["padding_fraction"]
    assert packed["real_tokens"] > buckets["real_tokens"]
    assert (
        32 < lines[0]["longest"] <= 48 and lines[0]["run_wide_length"] == 48
    )  # the longest example's bucket
    assert wide["shapes"] == [48] and wide["compilations"] == 1
    assert wide["padded_tokens"] == 2 * 8 * 48  # 2 steps of 8 examples
    assert buckets["real_tokens"] == wide["real_tokens"] and buckets["padded_tokens"] < wide["padded_tokens"]
    # this stream (seed 0): buckets 32 then 48 (two compilations), grouped 32 twice (one)
    assert buckets["shapes"] == [32, 48] and buckets["compilations"] == 2
    assert grouped["shapes"] == [32] and grouped["compilations"] == 1
    # each mode's padded tokens are its batch shapes' (8 examples a step), whatever it logs as a fraction
    assert (buckets["padded_tokens"], grouped["padded_tokens"]) == (8 * 32 + 8 * 48, 2 * 8 * 32)
    assert wide["padding_fraction"] > buckets["padding_fraction"]  # the same real tokens, fewer padded
    assert all(0 < r["padding_fraction"] < 1 for r in rows)
    for r in rows:
        assert r["end_to_end_s"] > r["steady_s"] > 0 and r["compile_s"] > 0
        # one model and one peak: MFU is in proportion to real tokens/s, mode for mode
        assert r["mfu"] / r["real_tokens_per_sec"] == pytest.approx(wide["mfu"] / wide["real_tokens_per_sec"])


def test_longtail_lognormal_lengths():
    """median and p99 as asked (σ = log 8 / z_0.99 for p99 = 8 × median), clipped to [low, high]."""
    import longtail
    import numpy as np

    x = longtail.lognormal_lengths(np.random.default_rng(0), 200000, 128, 1024, 8, 4096)
    assert np.median(x) == pytest.approx(128, rel=0.02)
    assert np.percentile(x, 99) == pytest.approx(1024, rel=0.05)
    y = longtail.lognormal_lengths(np.random.default_rng(0), 1000, 128, 1024, 16, 512)
    assert y.min() >= 16 and y.max() == 512


def test_remat_policies_and_auto_resolve_by_compiled_memory(monkeypatch, capsys):
    """--remat (plumbing.Remat): each policy compiles, keeping less the more it recomputes (off > save_dots ≥
    minimal ≥ full in compiled peak); auto is off on CPU (no memory limit, nothing compiled); with a faked
    device where off does not fit 90% and save_dots does, auto compiles them in turn, picks save_dots, logs
    each one's need, and the step then is --remat save_dots's, number for number (to float32 rounding).
    str(remat) is the resolved mode (what args.json records). Remat changes memory, not the math: full's
    compiled step (run once) gives off's loss and gradient norm, as save_dots' does."""
    import blocks
    import harness
    import jax
    import numpy as np
    import plumbing

    mesh, out, peaks = harness.common.make_mesh("data=8"), {}, {}
    monkeypatch.setattr(blocks, "remembered", lambda key, mode=None: None)  # decided afresh (test_chip: kept)

    def make(mode, limit):
        monkeypatch.setattr(blocks, "device_memory_limit", lambda: limit)
        cfg = throughput.Args(
            algo="sft", model="tiny", random_init=True, batch_size=16, max_length=128, remat=mode
        )  # long enough that activations, not weights, set the peak
        backbone = harness.load_backbone(cfg, mesh)
        remat = plumbing.Remat(cfg.remat, backbone)
        bench = harness.setup(cfg, backbone, mesh)
        return cfg, remat, bench

    for mode in ("off", "save_dots", "minimal", "full"):
        _, remat, bench = make(mode, None)
        spec = harness.shape_of((bench.state, bench.batch, bench.extra))
        compiled = remat.jit(bench.step, donate_argnums=0).lower(*spec).compile()
        peaks[mode] = plumbing.peak_bytes(compiled)
        if mode == "full":  # its step, run once (the state is donated), for its numbers below
            full = jax.device_get(compiled(bench.state, bench.batch, bench.extra)[1])
    assert peaks["off"] > peaks["save_dots"] >= peaks["minimal"] >= peaks["full"], peaks
    limit = (peaks["off"] + peaks["save_dots"]) / 2 / 0.9  # 90% of it: between off's need and save_dots'
    for mode, device in (("auto", None), ("auto", limit), ("save_dots", None)):
        cfg, remat, bench = make(mode, device)
        step = remat.jit(bench.step, donate_argnums=0)
        shapes = harness.shape_of((bench.state, bench.batch, bench.extra))  # the state is donated below
        _, metrics = step(bench.state, bench.batch, bench.extra)  # resolves auto on the first call
        # a fresh callable: traced anew (jax caches traces per function), as Remat.jit's own jit is
        remats = str(jax.make_jaxpr(functools.partial(bench.step))(*shapes)).count("remat")
        out[mode, device] = str(remat), remats, jax.device_get(metrics), capsys.readouterr().out
        assert cfg.remat == mode  # the flag itself is never rewritten
    assert out["auto", None][0] == "off"
    assert "remat: auto -> off (cpu: no device memory limit)" in out["auto", None][3]
    assert out["auto", limit][0] == "save_dots"
    said = out["auto", limit][3]
    assert f"remat: auto -> save_dots (compiled peak per device: off {peaks['off'] / 2**30:.2f} GiB" in said
    # one checkpoint a decoder block (tiny: 4)
    assert out["save_dots", None][0] == "save_dots" and out["save_dots", None][1] == out["auto", None][1] + 4
    assert out["auto", limit][1] == out["save_dots", None][1]
    for k in ("train/loss", "train/grad_norm"):
        np.testing.assert_allclose(out["auto", limit][2][k], out["save_dots", None][2][k], rtol=1e-6)
        np.testing.assert_allclose(out["auto", None][2][k], out["save_dots", None][2][k], rtol=1e-5)
    # full (every block recomputed in float32) against off (auto on CPU): the same step
    np.testing.assert_allclose(full["train/loss"], out["auto", None][2]["train/loss"], rtol=1e-6)
    np.testing.assert_allclose(full["train/grad_norm"], out["auto", None][2]["train/grad_norm"], rtol=1e-5)


def test_checkpoint_cost_is_measured_through_the_run(tmp_path, capsys):
    """benchmarks/checkpoint.py times plumbing.Run.checkpoint itself: one save per step, each a complete
    orbax step dir, and the rate applied to 12 bytes a parameter at real sizes."""
    import checkpoint

    checkpoint.main(checkpoint.Args(gib=0.125, repeats=4, output_dir=str(tmp_path / "ck")))
    row = last_json(capsys)
    assert row["gib"] == 0.125 and len(row["times"]) == 4 and row["seconds"] > 0
    assert row["gemma_2b_save_seconds"] == pytest.approx(12 * 2.506e9 / (row["gb_per_s"] * 1e9))
    assert not (tmp_path / "ck").exists()  # removed after measuring


def test_draw_times_the_fused_kernel_beside_xlas_draw(capsys):
    """benchmarks/draw.py: one row a variant, XLA's draw first, then the kernel at each block (on CPU in
    Pallas' interpreter), each drawing XLA's tokens."""
    import draw

    draw.main(
        draw.Args(batch_size=4, hidden_dim=32, vocabulary_size=500, blocks=(128, 256), steps=2, repeats=1)
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["variant"] for r in rows] == ["xla", "kernel_128", "kernel_256"]
    assert all(r["ms_per_draw"] > 0 and r["same_tokens_as_xla"] == 1.0 for r in rows)


def test_tpu_check_runs_its_commands_on_cpu(tmp_path):
    """benchmarks/tpu_check.sh with SMOKE=1: the chip's commands at `tiny` shape on the CPU (the bf16 matmul,
    the README pipeline's flags as each script parses them, the throughput rows, a decode row), each one JSON
    line of results.jsonl with what, device, date and command beside its figures."""
    import subprocess

    env = {**os.environ, "SMOKE": "1", "OUT": str(tmp_path), "PY": sys.executable}
    env["PARTS"] = "matmul flags throughput decode memory"
    env["ROWS"] = (
        "^(matmul|script_flags|lora_2b$|grpo_update|decode|memory)"  # one process a row: the suite's time
    )
    env["XLA_FLAGS"] = FAST_COMPILE  # one CPU device, as a lone chip; compiled fast: one or two steps a row
    out = subprocess.run(
        ["bash", "benchmarks/tpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    whats = [r["what"] for r in rows]
    assert whats == [
        "matmul_bf16",
        "script_flags",
        "lora_2b",
        "grpo_update_2b",
        "decode_2b_b4",
        "decode_2b_b4_g2",
        "memory_2b_2layers_b4",
    ], whats
    bad = [(r["what"], r.get("error")) for r in rows if r["rc"] != 0]
    assert not bad, bad
    assert all(r["device"] == "cpu" and r["date"] and r["command"] for r in rows)
    assert rows[1]["commands"] == 11  # the whole pipeline, evaluate.py included
    assert all(0 < r["mfu"] <= 1 and r["tokens_per_sec"] > 0 for r in rows[2:4])
    assert {r["remat"] for r in rows[2:4]} == {"off"}  # auto on CPU: no memory limit
    assert rows[4]["ms_per_step"] > 0 and rows[4]["bandwidth_source"] == "probe"
    # beside it, the same sampler with XLA's draw (on a CPU both draw so: the fused kernel is a chip's)
    assert rows[4]["plain_draw"] and rows[4]["fused_draw"] is False and rows[4]["same_tokens"] == 1.0
    # 2 prompts of 2 rows, each prefilled once, beside every row prefilled: the share of equal tokens
    assert rows[5]["num_generations"] == 2 and rows[5]["before_prefill_s"] > 0 < rows[5]["after_prefill_s"]
    assert rows[5]["same_tokens"] == 1.0  # on CPU in float32, every token (a bf16 chip: 99.9%)
    # CPU: no measured peak; the compiler's own total of the device's memory holds the arguments
    memory = rows[6]
    assert memory["peak_bytes_per_device"] > 0 and memory["measured_peak_bytes"] is None
    assert memory["argument_bytes"] < memory["hbm_bytes_per_device"] < 2 * memory["peak_bytes_per_device"]


def test_chip_results_are_well_formed_and_in_results_md():
    """benchmarks/results/*.jsonl: one JSON object a line with what, device, date and command; a measurement
    that ran (rc 0) carries its figures under the names throughput.py and decode.py print (a later line of the
    same `what` supersedes an earlier one); and benchmarks/RESULTS.md names every `what` that ran."""
    import re

    folder = os.path.join(ROOT, "benchmarks", "results")
    figures = {
        "full_ft": ("mfu", "tokens_per_sec"),
        "lora": ("mfu", "tokens_per_sec"),
        "grpo_update": ("mfu", "tokens_per_sec", "generate_s"),
        "decode": ("ms_per_step", "tokens_per_sec"),
    }
    results = open(os.path.join(ROOT, "benchmarks", "RESULTS.md")).read()
    files = sorted(f for f in os.listdir(folder) if f.endswith(".jsonl"))
    assert "tpu_v5e.jsonl" in files
    for name in files:
        latest = {}
        for i, line in enumerate(open(os.path.join(folder, name)).read().splitlines(), 1):
            row = json.loads(line)
            assert {"what", "device", "date", "command", "rc"} <= row.keys(), f"{name}:{i}"
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]), f"{name}:{i}"
            latest[row["what"]] = row
        for what, row in latest.items():
            if row["rc"] != 0:
                continue
            for prefix, keys in figures.items():
                if what.startswith(prefix):
                    assert all(isinstance(row.get(k), float) for k in keys), f"{name}: {what} lacks {keys}"
            assert f"`{what}`" in results or what.startswith(("script_", "matmul")), (
                f"RESULTS.md: no `{what}`"
            )


def test_tools_task_stages_split_a_run_across_calls(tmp_path, monkeypatch):
    """--stages: each call runs only the stages named, in chain order, and walls.json keeps every call's wall
    times (the SFT starts on an accelerator, the GRPO rows elsewhere, one folder); a stage not there is
    one line, exit 2; the report waits for the chain's last stage (rft, the rejection-sampling control)."""
    import plumbing
    import tools_task

    ran = []
    monkeypatch.setattr(
        tools_task, "run", lambda cmd, log: ran.append((cmd[1], "--tools" in cmd and cmd)) or 1.0
    )
    monkeypatch.setattr(tools_task, "report", lambda args, walls: ran.append(("report", dict(walls))))
    args = lambda stages: tools_task.Args(output_dir=str(tmp_path), seeds=2, first_seed=3, stages=stages)
    tools_task.main(args(("sft",)))
    assert [r[0] for r in ran] == ["sft.py", "sft.py"]  # seeds 3 and 4, no GRPO, no report
    ran.clear()
    tools_task.main(args(("tools",)))
    assert [r[0] for r in ran] == ["grpo_tools.py"] * 2  # the control not yet run: no report
    ran.clear()
    tools_task.main(args(("tools", "control")))
    assert [r[0] for r in ran] == ["grpo_tools.py"] * 4  # rft not yet run: no report
    tools_flags = [cmd[cmd.index("--tools") + 1] for _, cmd in ran[:4]]
    assert sorted(tools_flags).count("--reward-fn") == 2  # the control: --tools given nothing
    ran.clear()
    tools_task.main(args(("rft",)))
    assert [r[0] for r in ran] == ["grpo_tools.py"] * 2 + ["report"]
    cmds = [cmd for _, cmd in ran[:2]]
    assert all(cmd[cmd.index("--accept-reward") + 1] == "1" and "--tools" in cmd for cmd in cmds)
    walls = json.load(open(tmp_path / "walls.json"))
    assert walls["seed3"] == walls["seed4"] == {"sft": 1.0, "tools": 1.0, "control": 1.0, "rft": 1.0}
    assert ran[-1][1]["seed4"] == walls["seed4"]
    with pytest.raises(
        plumbing.UsageError, match="^--stages sfft: expected some of sft, tools, control, rft"
    ):
        tools_task.main(args(("sfft",)))


def test_scan_compile_proxy_runs_both_stacks_to_the_same_loss(capsys):
    """benchmarks/scan_compile.py (tpu_check's `scan` part): the unrolled and the scanned stack of blocks
    are the same step (the loss after one update agrees), each with its compile, executable and step timed."""
    import scan_compile

    scan_compile.main(
        scan_compile.Args(layers=2, hidden=32, ffn=64, heads=2, head_dim=8, rank=2, batch=2, seq=8, steps=1)
    )
    row = last_json(capsys)
    assert row["same_loss"] and row["layers"] == 2
    for name in ("unrolled", "scanned"):
        assert row[name]["compile_s"] > 0 and row[name]["executable_mb"] > 0 and row[name]["step_ms"] > 0
