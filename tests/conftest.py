"""Every test process sees 8 simulated CPU devices (set before JAX is imported); the reward
model that PPO and GRPO tests score with is trained once per session."""

import os
import subprocess
import sys

import pytest

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def reward_run(tmp_path_factory):
    """reward.py from random init on one device (8 simulated devices on 2 cores take 2.5x as
    long; the sharded path is tested elsewhere): eval/accuracy must reach 0.75 (50 steps: 0.88
    measured on one device and on 8; the documented 80-step command reaches 0.92)."""
    out = tmp_path_factory.mktemp("reward")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "reward.py"), "--model", "tiny", "--max-steps", "50",
                          "--eval-every", "50", "--normalize", "--output-dir", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=900, env=one_device_env())
    assert res.returncode == 0, res.stderr[-2000:]
    return str(out)


def one_device_env():
    """The environment of a subprocess that sees one CPU device instead of 8 simulated ones."""
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=1".strip()
    return env
