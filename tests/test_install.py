"""The lean install: requirements.txt is a complete lock installed with `pip install --no-deps`,
so it must name every package the project's packages need (TensorFlow excepted), and no
script may import TensorFlow."""

import importlib.metadata as md
import os
import re
import subprocess
import sys

from packaging.markers import default_environment
from packaging.requirements import Requirement

from helpers import ROOT

# keras-hub 0.32 declares tensorflow-text; without it keras-hub tokenizes through sentencepiece
# and tokenizers, so the lock leaves it (and the TensorFlow it brings) out on purpose.
LEFT_OUT = {("keras-hub", "tensorflow-text")}


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def lock():
    """requirements.txt -> {canonical name: pinned version}; every line must be `name==version`."""
    pins = {}
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        for number, line in enumerate(f, 1):
            line = line.split("#")[0].strip()
            if line:
                match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
                assert match, f"requirements.txt:{number}: {line!r} is not pinned as name==version"
                pins[canonical(match[1])] = match[2]
    return pins


def test_lock_is_closed_under_declared_dependencies():
    """Each pinned package is installed at its pin, and each of its requirements (markers
    evaluated for this machine, no extras) is pinned too, at a version it accepts."""
    pins = lock()
    assert not {"tensorflow", "tensorflow-text"} & pins.keys()
    environment = default_environment() | {"extra": ""}
    problems = []
    for name, version in pins.items():
        installed = md.version(name)
        if installed != version:
            problems.append(f"{name}: installed {installed}, pinned {version}")
            continue
        for spec in md.requires(name) or []:
            req = Requirement(spec)
            if req.marker is not None and not req.marker.evaluate(environment):
                continue
            dep = canonical(req.name)
            if (name, dep) in LEFT_OUT:
                continue
            if dep not in pins:
                problems.append(f"{name} needs {spec!r}, which requirements.txt does not pin")
            elif not req.specifier.contains(pins[dep], prereleases=True):
                problems.append(f"{name} needs {spec!r}, requirements.txt pins {dep}=={pins[dep]}")
    assert not problems, "\n".join(problems)


def test_no_tensorflow_in_a_run():
    """Load `tiny`, tokenize with it, save it as a preset and load that back (keras-hub's
    tokenizer and preset paths), then list any TensorFlow module the process imported."""
    code = """
import sys, tempfile, common
model = common.load_model("tiny", common.make_mesh())
ids = model.preprocessor.tokenizer(["Sort: 3 1 2"])
with tempfile.TemporaryDirectory() as d:
    model.save_to_preset(d)
    import keras_hub
    keras_hub.models.CausalLM.from_preset(d)
print(sorted(m for m, v in sys.modules.items() if v is not None and m.split(".")[0] in ("tensorflow", "tensorflow_text")))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
