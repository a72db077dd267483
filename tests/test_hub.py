"""Model-hub failures end in one line saying what to do (exit 2), and --export-hf's refusal.

The scripts run with the network made unreachable (a refused proxy, as well as this machine's
lack of network) and no credentials: the real offline path. The hubs' answers that need a
network (403 licence, 404 unknown repo) are built locally as the real exception types, through
kagglehub's and huggingface_hub's own response handling, and KerasHub's own conversion of them.
"""

import json
import os
import time

import pytest
import requests

import common
import interop
from helpers import one_device_env, run_script

KAGGLE_GEMMA = "kaggle://keras/gemma/keras/gemma_2b_en/2"


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    """No Kaggle or Hugging Face credentials and empty caches, in this process and its children."""
    for var in (
        "KAGGLE_USERNAME",
        "KAGGLE_KEY",
        "KAGGLE_API_TOKEN",
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_HUB_OFFLINE",
        "NO_PROXY",
        "no_proxy",
        "ALL_PROXY",
        "all_proxy",
    ):
        monkeypatch.delenv(var, raising=False)
    for var in ("HOME", "KAGGLE_CONFIG_DIR", "KAGGLEHUB_CACHE", "HF_HOME"):
        monkeypatch.setenv(var, str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    "model, hints",
    [
        (
            "gemma3_1b",
            [
                "cannot reach Kaggle",
                "kaggle://keras/gemma3/keras/gemma3_1b",
                "KAGGLE_USERNAME and",
                "~/.kaggle/kaggle.json",
                "licence at https://www.kaggle.com/models/keras/gemma3;",
                "local dir",
            ],
        ),
        (
            "kaggle://keras/gemma/keras/gemma_2b_en",
            ["cannot reach Kaggle", "KAGGLE_USERNAME", "local directory"],
        ),
        ("hf://google/gemma-2b", ["the Hugging Face Hub cannot be reached", "HF_TOKEN", "local directory"]),
    ],
)
def test_unreachable_hub_is_one_line(model, hints, no_credentials):
    env = one_device_env()
    for var in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        env[var] = "http://127.0.0.1:9"  # nothing listens there: unreachable even with a network
    start = time.perf_counter()
    res = run_script(
        "dpo.py", "--model", model, "--dataset", "my_prefs.jsonl", "--eval-dataset", "", env=env, timeout=120
    )
    took = time.perf_counter() - start
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --model "), res.stderr[-3000:]
    for hint in hints:
        assert hint in lines[0]
    assert took < 20, took  # no retries with backoff (huggingface_hub's alone took 23 s)


def kaggle_error(status):
    """kagglehub's KaggleApiHTTPError for an HTTP `status`, made by kagglehub's own handler."""
    from kagglehub.exceptions import handle_call

    response = requests.Response()
    response.status_code, response.url = status, "https://api.kaggle.com/v1/models.ModelApiService/Download"

    def call():
        raise requests.HTTPError(f"{status} Client Error", response=response)

    try:
        handle_call(call)
    except Exception as e:
        return e


def hf_error(status, code):
    """huggingface_hub's error for an HTTP answer (`code`: its X-Error-Code header), by hf_raise_for_status."""
    import httpx2
    from huggingface_hub.utils import hf_raise_for_status

    url = "https://huggingface.co/google/gemma-2b/resolve/main/config.json"
    try:
        hf_raise_for_status(
            httpx2.Response(status, headers={"X-Error-Code": code}, request=httpx2.Request("HEAD", url))
        )
    except Exception as e:
        return e


@pytest.mark.parametrize(
    "status, user, expected",
    [
        (
            403,
            None,
            "Kaggle refused kaggle://keras/gemma/keras/gemma_2b_en/2 without credentials: set Kaggle "
            "credentials (KAGGLE_USERNAME and KAGGLE_KEY, or ~/.kaggle/kaggle.json) for an account that has "
            "accepted the model's licence at https://www.kaggle.com/models/keras/gemma",
        ),
        (
            403,
            "alice",
            "to the Kaggle account 'alice': accept the model's licence at "
            "https://www.kaggle.com/models/keras/gemma with that account",
        ),
        (401, "alice", "to the Kaggle account 'alice': accept"),
        (404, None, "Kaggle has no model kaggle://keras/gemma/keras/gemma_2b_en/2: check the handle"),
    ],
)
def test_kaggle_answers(status, user, expected, no_credentials, monkeypatch):
    """Through backbone_class (the first hub contact) and KerasHub's get_file, which re-raises
    kagglehub's 403/404 as FileNotFoundError and other codes as ValueError."""
    import kagglehub

    if user:
        monkeypatch.setenv("KAGGLE_USERNAME", user)
        monkeypatch.setenv("KAGGLE_KEY", "0123")

    def download(handle, path):
        assert (handle, path) == (KAGGLE_GEMMA.removeprefix("kaggle://"), "config.json")
        raise kaggle_error(status)

    monkeypatch.setattr(kagglehub, "model_download", download)
    with pytest.raises(common.UsageError) as e:
        common.backbone_class(KAGGLE_GEMMA)
    assert expected in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "status, code, expected",
    [
        (
            404,
            "RepoNotFound",
            "no Hugging Face repo 'google/gemma-2b' is visible: check the repo id at "
            "https://huggingface.co/google/gemma-2b (for a private repo, set HF_TOKEN",
        ),
        (
            403,
            "GatedRepo",
            "the repo is gated: accept its licence at https://huggingface.co/google/gemma-2b, "
            "then set HF_TOKEN",
        ),
    ],
)
def test_hugging_face_answers(status, code, expected, no_credentials, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(no_credentials))  # nothing cached
    error = hf_error(status, code)
    assert (
        type(error).__name__
        == {"RepoNotFound": "RepositoryNotFoundError", "GatedRepo": "GatedRepoError"}[code]
    )

    def head(url, **kwargs):
        raise error

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", head)
    with pytest.raises(common.UsageError) as e:
        common.backbone_class("hf://google/gemma-2b")
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_malformed_handles_and_other_errors():
    with pytest.raises(common.UsageError, match=r"not a Kaggle model handle; expected kaggle://\{org\}"):
        common.backbone_class("kaggle://keras/gemma")
    with pytest.raises(
        common.UsageError, match=r"not a Hugging Face repo id; expected hf://\{org\}/\{model\}"
    ):
        common.backbone_class("hf://not a/repo id!")
    assert interop.hub_error("gemma_2b_en", RuntimeError("out of memory")) is None  # not a hub failure
    assert interop.hub_error("tiny", ConnectionError()) is None


def check_export_hf(model):
    """interop.check_export_hf as plumbing.Run calls it."""
    preset = common.resolve_model(model)
    interop.check_export_hf(model, preset, common.backbone_class(preset).__name__)


def test_export_hf_refuses_an_unsupported_family(tmp_path):
    """keras-hub 0.32 writes Gemma 2 (a GemmaBackbone with post-norms) as a Gemma 1 checkpoint, which
    would drop those norms, and a Gemma with several key/value heads (7B) as one with the first alone:
    refused at start-up, before data or weights load; so is Llama 2."""
    config = {"registered_name": "keras_hub>GemmaBackbone", "config": {"use_post_ffw_norm": True}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    res = run_script(
        "sft.py",
        "--model",
        str(tmp_path),
        "--export-hf",
        "--dataset",
        "my.jsonl",
        "--eval-dataset",
        "",
        "--output-dir",
        str(tmp_path / "out"),
        env=one_device_env(),
        timeout=120,
    )
    assert res.returncode == 2, res.stderr[-3000:]
    exporters = (
        "GPT2Backbone, Gemma3Backbone, Gemma4Backbone, GemmaBackbone, Llama3Backbone, MistralBackbone, "
        "Qwen3_5Backbone, QwenBackbone"
    )
    assert res.stderr.strip().splitlines() == [
        "error: --export-hf: keras-hub 0.32.0 cannot write Gemma 2 (GemmaBackbone with post-norms and soft-caps) "
        f"as a Hugging Face checkpoint (--model {tmp_path}); it can write {exporters}"
    ]
    assert not os.path.exists(tmp_path / "out")
    (tmp_path / "config.json").write_text(
        json.dumps({"registered_name": "keras_hub>LlamaBackbone", "config": {}})
    )
    with pytest.raises(common.UsageError, match="cannot write LlamaBackbone as a Hugging Face checkpoint"):
        check_export_hf(str(tmp_path))
    check_export_hf("tiny")  # a GemmaBackbone without Gemma 2's extras
    gemma_7b = tmp_path / "gemma_7b"  # 16 key/value heads, of which keras-hub's exporter writes the first
    gemma_7b.mkdir()
    (gemma_7b / "config.json").write_text(
        json.dumps({"registered_name": "keras_hub>GemmaBackbone", "config": {"num_key_value_heads": 16}})
    )
    with pytest.raises(common.UsageError, match="cannot write a Gemma with several key/value heads"):
        check_export_hf(str(gemma_7b))
