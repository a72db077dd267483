"""--dataset as TRL users name it: a .parquet file, a `save_to_disk` folder (Dataset or DatasetDict), a
Hub id with --dataset-config / --dataset-split, and --eval-split taking the eval set from the same
dataset. Everything goes through the real `datasets` code on folders made here; the Hub itself is not
reachable from this machine, so a Hub id is checked on its failure paths (offline, unreachable), which
must end in one line, fast. Reads are in-process calls; one subprocess checks the exit code."""

import os
import re
import socket
import time

import pytest

import common
from helpers import ROOT, one_device_env, run_script, usage_error

PAIRS = [
    {"prompt": "Sort: 2 1", "chosen": " 1 2", "rejected": " 2 1"},
    {"prompt": "Sort: 3 1", "chosen": " 1 3", "rejected": " 3 1"},
]
HELD_OUT = [{"prompt": "Sort: 5 4", "chosen": " 4 5", "rejected": " 5 4"}]
SCRIPTS = ("sft", "dpo", "simpo", "orpo", "kto", "reward")  # the ones with an eval set


def rows_of(rows):
    return [(row, i) for i, row in enumerate(rows, 1)]


@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
    """`load_dataset(...).save_to_disk(dir)` as for HuggingFaceH4/ultrafeedback_binarized: a DatasetDict
    folder with TRL's split names; its test split's one row fits no script's format."""
    import datasets

    path = str(tmp_path_factory.mktemp("data") / "prefs")
    datasets.DatasetDict(
        train_prefs=datasets.Dataset.from_list(PAIRS),
        test_prefs=datasets.Dataset.from_list(HELD_OUT),
        broken=datasets.Dataset.from_list([{"question": "?"}]),
    ).save_to_disk(path)
    return path


def test_a_saved_dataset_folder_is_one_split(tmp_path):
    import datasets

    datasets.Dataset.from_list(PAIRS).save_to_disk(str(tmp_path / "saved"))
    assert common.read_rows(str(tmp_path / "saved")) == rows_of(PAIRS)
    with pytest.raises(common.UsageError, match=r"saved: no split 'test'; its splits: train$"):
        common.read_rows(str(tmp_path / "saved"), "--dataset", None, "test")


def test_a_dataset_dict_folder_reads_the_split_asked_for(prefs):
    assert common.read_rows(prefs, "--dataset", None, "train_prefs") == rows_of(PAIRS)
    assert common.read_rows(prefs, "--eval-dataset", None, "test_prefs") == rows_of(HELD_OUT)
    triples = common.read_dataset(
        prefs, "preference", common.chat_template("tiny"), "--dataset", None, "train_prefs"
    )
    assert triples == [(r["prompt"], r["chosen"], r["rejected"]) for r in PAIRS]


def test_a_missing_split_is_refused_listing_the_splits(prefs):
    """The default split is `train`, which TRL's preference datasets do not have."""
    with pytest.raises(common.UsageError) as e:
        common.read_rows(prefs)
    assert str(e.value) == f"--dataset {prefs}: no split 'train'; its splits: train_prefs, test_prefs, broken"
    with pytest.raises(
        common.UsageError, match="--eval-dataset .*: name a split \\(--eval-split\\); its splits"
    ):
        common.read_rows(prefs, "--eval-dataset", None, None)  # --eval-dataset a DatasetDict, no --eval-split


def test_eval_split_takes_the_eval_set_from_the_same_dataset(prefs, tmp_path):
    """--eval-split picks a split of --dataset in place of the script's bundled eval file, or of
    --eval-dataset when one is given; --eval-dataset "" means no evaluation, and so does your own --dataset
    without an eval set named (TRL evaluates only when asked): the bundled eval file goes with the bundled
    training file only."""
    defaults = ("data/prefs_train.jsonl", "data/prefs_eval.jsonl")
    of = "--eval-split of --dataset"  # the flag its messages name: the user typed no --eval-dataset
    assert common.eval_source(prefs, defaults[1], "test_prefs", defaults) == (prefs, "test_prefs", of)
    assert common.eval_source(prefs, "other", "test", defaults) == ("other", "test", "--eval-dataset")
    assert common.eval_source(prefs, "other", None, defaults) == ("other", None, "--eval-dataset")
    assert common.eval_source(prefs, defaults[1], None, defaults) == (
        None,
        None,
        None,
    )  # own data: no toy eval
    assert common.eval_source(defaults[0], defaults[1], None, defaults)[:2] == (
        defaults[1],
        None,
    )  # the toy task
    assert common.eval_source(prefs, "", None, defaults)[:2] == (None, None)
    with pytest.raises(common.UsageError, match='--eval-split test: --eval-dataset "" turns evaluation off'):
        common.eval_source(prefs, "", "test", defaults)
    # A real model's run never gets the bundled eval file: its own split, its own file, or none.
    import dpo
    import plumbing

    assert plumbing.cli(dpo.Args, ["--model", "gemma_2b", "--dataset", prefs, "--eval-split=test_prefs"])
    assert plumbing.cli(dpo.Args, ["--model", "gemma_2b", "--dataset", prefs])
    # Each script's main: the eval set is read from --dataset's split (its bad row is named), and before
    # the training split (whose default, `train`, this folder lacks).
    for name in SCRIPTS:
        script = __import__(name)
        flags = ["--model", "tiny", "--dataset", prefs, "--output-dir", str(tmp_path / name)]
        assert usage_error(script, *flags, "--eval-split", "broken").startswith(f"{prefs}:1: "), name
        assert (
            usage_error(script, *flags, "--eval-split", "test")
            == f"{of} {prefs}: no split 'test'; its splits: train_prefs, test_prefs, broken"
        ), name  # not --eval-dataset
        assert not os.path.exists(tmp_path / name)


def hub_copy(repo, field):
    """A Hub dataset with configurations (gsm8k's `main`/`socratic`) and splits, as `git clone` leaves it:
    the README's `configs:` table, read by datasets' own Hub loader; one row each, `field` "config split"."""
    for config in ("main", "socratic"):
        (repo / config).mkdir(parents=True)
        for split in ("train", "test"):
            (repo / config / f"{split}-00000-of-00001.jsonl").write_text(
                f'{{"{field}": "{config} {split}", "answer": "4"}}\n'
            )
    (repo / "README.md").write_text(
        "---\nconfigs:\n"
        + "".join(
            f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train-*\n"
            f"  - split: test\n    path: {c}/test-*\n"
            for c in ("main", "socratic")
        )
        + "---\n"
    )
    return repo


def test_a_local_copy_of_a_hub_repo_takes_dataset_config(tmp_path):
    """datasets' own Hub loader reads the configuration and split asked for, afresh: an edit shows, and so
    does another folder of the same name (its cache, keyed by name and configs, served stale rows for both);
    without a configuration, its message names the flag."""
    repo = hub_copy(tmp_path / "gsm8k", "question")
    assert common.read_rows(str(repo), "--dataset", "socratic", "test") == [
        ({"question": "socratic test", "answer": "4"}, 1)
    ]
    (repo / "socratic" / "test-00000-of-00001.jsonl").write_text('{"question": "edited", "answer": "5"}\n')
    assert common.read_rows(str(repo), "--dataset", "socratic", "test") == [
        ({"question": "edited", "answer": "5"}, 1)
    ]
    other = hub_copy(tmp_path / "other" / "gsm8k", "prompt")
    assert common.read_rows(str(other), "--dataset", "main", "train") == [
        ({"prompt": "main train", "answer": "4"}, 1)
    ]
    with pytest.raises(common.UsageError) as e:
        common.read_rows(str(repo))
    assert str(e.value) == (
        f"--dataset {repo}: Config name is missing. Please pick one among the available "
        "configs: ['main', 'socratic'] (--dataset-config)"
    )


def test_gsm8k_writes_the_file_its_reward_function_reads(tmp_path):
    """`python data/gsm8k.py --out F` (the README's GSM8K line): one split of the `main` configuration as `prompt`
    (GSM8K's question) + `answer` rows, here from a local clone of the Hub repo."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("gsm8k", os.path.join(ROOT, "data", "gsm8k.py"))
    gsm8k = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gsm8k)
    repo = hub_copy(tmp_path / "gsm8k", "question")
    out = tmp_path / "test.jsonl"
    gsm8k.main(gsm8k.Args(out=str(out), split="test", source=str(repo)))
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        {"prompt": "main test", "answer": "4"}
    ]


def test_evaluate_takes_a_hub_datasets_config_and_split(tmp_path):
    """evaluate.py's --prompts reads a Hub dataset as --dataset does, with its own --prompts-config and
    --prompts-split; datasets' messages name those flags."""
    import evaluate

    repo = str(hub_copy(tmp_path / "gsm8k", "prompt"))
    mesh = common.make_mesh(None)
    args = evaluate.Args(prompts=repo, prompts_config="socratic", prompts_split="test")
    prompts, rows, _ = evaluate.check_args(args, mesh)
    assert rows == [{"prompt": "socratic test", "answer": "4"}] and prompts == ["socratic test"]
    with pytest.raises(common.UsageError, match=r"configs: \['main', 'socratic'\] \(--prompts-config\)$"):
        evaluate.check_args(evaluate.Args(prompts=repo), mesh)
    with pytest.raises(
        common.UsageError, match=r"name a split \(--prompts-split\); its splits: train, test$"
    ):
        evaluate.check_args(evaluate.Args(prompts=repo, prompts_config="main"), mesh)
    with pytest.raises(
        common.UsageError, match=r"configs: \['main', 'socratic'\]$"
    ):  # compare.py: no such flag
        common.read_rows(repo, "--eval-prompts")


def test_parquet_reads_through_the_lock(tmp_path):
    """`datasets` and `pyarrow` are in requirements.txt, so a .parquet file needs no extra install."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open(os.path.join(ROOT, "requirements.txt")) as f:
        pinned = set(re.findall(r"^([A-Za-z0-9_.-]+)==", f.read(), re.M))
    assert {"datasets", "pyarrow"} <= pinned
    pq.write_table(pa.Table.from_pylist(PAIRS), tmp_path / "prefs.parquet")
    assert common.read_rows(str(tmp_path / "prefs.parquet")) == rows_of(PAIRS)
    with pytest.raises(common.UsageError, match=r"prefs.parquet: no split 'test'; its splits: train$"):
        common.read_rows(str(tmp_path / "prefs.parquet"), "--dataset", None, "test")


def test_a_hub_id_offline_or_unreachable_is_one_fast_line(monkeypatch):
    """`org/name` is a Hub id, not a missing file. HF_HUB_OFFLINE without a cached copy, and a Hub that
    cannot be reached (nothing listens at the endpoint: refused at once), each say what to do, in well
    under the 23 s that load_dataset's retries take."""
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 sets at import
    with pytest.raises(common.UsageError) as e:
        common.read_rows("trl-lib/Capybara")
    assert str(e.value) == (
        "--dataset trl-lib/Capybara: no such local file or folder, and HF_HUB_OFFLINE is set "
        "and it is not in the local cache: unset it"
    )
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    with socket.socket() as s:  # a free port, closed again: connections to it are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    start = time.perf_counter()
    with pytest.raises(
        common.UsageError,
        match=r"^--dataset gsm8k: no such local file or folder, and the Hugging "
        r"Face Hub cannot be reached \(no network\?\): connect, or set "
        r"HF_HUB_OFFLINE=1 to use a cached copy$",
    ):
        common.read_rows("gsm8k", "--dataset", "main")
    assert time.perf_counter() - start < 5


def test_a_hub_id_offline_exits_2_in_one_line(tmp_path):
    """Through the CLI: HF_HUB_OFFLINE=1, nothing cached -> one line on stderr, exit 2, nothing written."""
    env = one_device_env() | {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    out = tmp_path / "out"
    res = run_script(
        "grpo.py", "--dataset", "trl-lib/DeepMath-103K", "--output-dir", str(out), env=env, timeout=120
    )
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip().splitlines() == [
        "error: --dataset trl-lib/DeepMath-103K: no such local file or "
        "folder, and HF_HUB_OFFLINE is set and it is not in the local cache: "
        "unset it"
    ]
    assert not out.exists()


# ---------------------------------------------------------------------------
# Your own files: a .csv is read, and what cannot be read is one line naming the fix
# ---------------------------------------------------------------------------
def test_a_csv_file_is_read_as_a_split_of_rows(tmp_path):
    """TRL's CSV datasets (`load_dataset("csv", ...)`): a .csv is one split, `train`, a row per line."""
    (tmp_path / "prefs.csv").write_text(
        "prompt,chosen,rejected\n" + "".join(f"{r['prompt']},{r['chosen']},{r['rejected']}\n" for r in PAIRS)
    )
    assert common.read_rows(str(tmp_path / "prefs.csv")) == rows_of(PAIRS)


def test_a_file_of_another_format_names_the_ones_read(tmp_path):
    (tmp_path / "notes.txt").write_text("Sort: 2 1\n")
    with pytest.raises(common.UsageError) as e:
        common.read_rows(str(tmp_path / "notes.txt"))
    assert str(e.value) == (
        f"--dataset {tmp_path / 'notes.txt'}: not a format read here; a data file is .jsonl, .json, .parquet, "
        ".csv (or a saved dataset folder, or a Hub dataset id)"
    )


def test_a_folder_of_files_with_different_columns_is_one_line(tmp_path):
    """datasets reads a folder of data files as one dataset; files whose columns differ stopped the run with a
    67-line DatasetGenerationError traceback. Now: one line, the columns that differ, and the fix."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"prompt": "Sort: 2 1", "completion": " 1 2"}\n')
    (folder / "b.jsonl").write_text('{"text": "Sort: 3 1 -> 1 3", "source": 7}\n')
    message = usage_error(__import__("sft"), "--dataset", str(folder), "--eval-dataset", "")
    assert "\n" not in message and message.startswith(f"--dataset {folder}: Couldn't cast")
    assert "because column names don't match" in message
    assert message.endswith(
        "datasets reads a folder's data files as one dataset: each needs the same columns"
    )


def test_evaluate_refuses_your_model_on_the_toy_prompts_and_says_what_it_scores(
    tmp_path, capsys, monkeypatch
):
    """A model trained on a --dataset of your own (its run's args.json says so), left to the bundled prompts
    and checker, is refused in one line naming --prompts and --reward-fn (it scored an arithmetic model on the
    sorting prompts: every response empty, 0). Given them, the first line says the file, its size, the scorer."""
    import json

    import evaluate
    import plumbing

    model = tmp_path / "my_dpo" / "model"  # a run's model/, from `tiny` (its tokenizer), on your data
    tiny = common.load_model("tiny", common.make_mesh(None), "float32")
    common.save_model(tiny, common.split_variables(tiny.backbone)[0], str(model))
    (tmp_path / "my_dpo" / "args.json").write_text(json.dumps({"dataset": str(tmp_path / "mine.jsonl")}))
    with pytest.raises(common.UsageError) as e:
        plumbing.cli(evaluate.Args, ["--model", str(model)])
    assert str(e.value) == (
        f"--model {model} would use the bundled toy task (data/): pass --prompts DATA, --reward-fn "
        "path.py:function; DATA: a .jsonl/.json/.parquet/.csv file, a saved dataset dir or a Hub dataset id"
    )
    with pytest.raises(common.UsageError) as e:  # a reward function is asked for alone: no DATA clause
        plumbing.cli(evaluate.Args, ["--model", str(model), "--prompts", "mine.jsonl"])
    assert str(e.value).endswith("would use the bundled toy task (data/): pass --reward-fn path.py:function")
    # Only a model folder's own run counts: `tiny` run from inside that run's folder is still the demo, and a
    # record without a --dataset (another tool's args.json above a model) leaves the tokenizer to decide
    monkeypatch.chdir(tmp_path / "my_dpo")
    assert plumbing.is_toy_model("tiny")
    (tmp_path / "my_dpo" / "args.json").write_text(json.dumps({"lr": 1e-4}))
    assert plumbing.is_toy_model(str(model))
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"Sort: {i} 1", "answer": f"1 {i}"}) + "\n" for i in range(5))
    )
    checker = os.path.join(ROOT, "data", "toy.py") + ":accuracy"
    flags = ["--model", str(model), "--prompts", str(prompts), "--reward-fn", checker, "--num-prompts", "3"]
    evaluate.check_args(plumbing.cli(evaluate.Args, flags), common.make_mesh(None))
    assert capsys.readouterr().out.splitlines()[0] == (
        f"eval: the first 3 of 5 prompts in --prompts {prompts}, scored by {checker}; greedy and sampled "
        "(T=1.0, seed 0), 256 new tokens; baseline: None"
    )
