"""The repository's shape, by reading its modules' source (plus one subprocess): the project's modules
import in one direction, interop <- common <- plumbing with everything else above them (imports inside
functions counted); no algorithm file, evaluate.py or compare.py imports interop; `import plumbing`
loads no JAX (`--help` stays instant); each module keeps to its budget in statements (ast.stmt, not
lines: the formatter unfolds freely and nothing is packed to fit); and every file is as `ruff format`
writes it."""

import ast
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))
ALGORITHMS = ("sft", "dpo", "simpo", "orpo", "kto", "reward", "ppo", "grpo", "rloo", "distill")
# Statements (ast.stmt) per file: what the file holds, however the formatter lays it out. The shared modules'
# budgets are their roles' (each has a table of contents); a script's is "about" (SLACK over it at most).
# about 700 each: common + frozen weights in the compute dtype and chunked log-probs (label_logp's backward
# written out), plumbing + remat policies, auto's halved micro-batches and the shared --adam-mu-dtype flag (a
# field and its help: 2 statements); kernels: the Pallas kernels (Splash attention's wrapper, the sampler's
# fused output layer and draw), ~100 each
SHARED = {"common": 740, "plumbing": 767, "interop": 300, "tpu_kernels": 115}
ABOUT = {
    "dpo": 250,
    "simpo": 250,
    "orpo": 250,
    "kto": 250,
    "sft": 220,
    "reward": 220,
    "ppo": 380,
    "grpo": 383,  # + the sampler's fused draw on a TPU chip (tpu_kernels.categorical: its `elif`)
    "rloo": 380,
    "distill": 290,
    "evaluate": 300,
    "grpo_tools": 400,  # grpo.py's loss and update imported; tools, their formats, the multi-turn sampler
    # + the data check, --quick, per-run progress, the summary with Holm's correction; each seed its own base,
    # controls matched to each row in information and FLOPs (run_control), the Δ matrix, results.json, and
    # what your pass-through flags replace, said before any run (overrides)
    "compare": 775,
    "compare_stats": 60,  # compare.py's intervals, p-values, Holm, the pairwise matrix
}
SLACK = 0.02


def imports(module):
    """The project modules `module` imports, at the top or inside any function or class."""
    with open(os.path.join(ROOT, module + ".py")) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(MODULES) - {module}


def cycle(graph):
    """One import circle of `graph` {module: the modules it imports} as a list of modules, or None."""
    state = {}  # absent: unvisited; 1: on the current path; 2: done

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (found := visit(n, path + [n])):
                return found
        state[m] = 2
        return None

    return next((c for m in sorted(graph) if m not in state and (c := visit(m, [m]))), None)


def test_cycle_finds_a_circle():
    """The check itself: a circle through three modules is found, a chain is not."""
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_imports_go_one_way():
    graph = {m: imports(m) for m in MODULES}
    assert {"interop", "common", "plumbing"} <= set(graph), MODULES
    assert cycle(graph) is None, f"an import circle: {' -> '.join(cycle(graph))}"
    assert graph["interop"] == set(), graph["interop"]  # the bottom: nothing of ours
    assert graph["tpu_kernels"] == set(), graph["tpu_kernels"]  # Pallas and JAX only
    assert graph["common"] == {"interop", "tpu_kernels"}, graph["common"]  # never the shell
    assert graph["plumbing"] <= {"common", "interop"}, graph["plumbing"]
    users = [m for m in (*ALGORITHMS, "evaluate", "compare") if "interop" in graph.get(m, ())]
    assert not users, f"{', '.join(users)} import interop (reach it through common or plumbing)"


# Top-level names that the stacks used beside this project import: transformers while it loads a model (and PEFT),
# as listed from sys.modules after `AutoModelForCausalLM.from_pretrained` + `import peft` (transformers 5.25), plus
# TRL, vLLM, datasets and JAX's libraries. Python finds the current folder first, so a module of ours by one of
# these names is imported in their place from the project's root: the Pallas module was once `kernels.py`, and
# transformers, which imports Hugging Face's `kernels` package while it builds a model, failed to load --export-hf's
# model_hf/ from here ("Could not import module 'GemmaForCausalLM'").
TAKEN = set(
    "kernels transformers peft accelerate trl vllm datasets huggingface_hub tokenizers safetensors sentencepiece "
    "torch torchgen numpy jinja2 yaml regex psutil sympy packaging filelock fsspec tqdm jax jaxlib keras keras_hub "
    "flax orbax optax qwix chex etils ml_dtypes absl tensorflow tyro tensorboardX wandb pyarrow".split()
)


def test_no_module_takes_a_name_the_stacks_import():
    taken = [f"{m}.py" for m in MODULES if m in TAKEN]
    assert not taken, f"{', '.join(taken)}: a name transformers, PEFT, TRL, vLLM or JAX's stack imports"
    assert "kernels" in TAKEN and "tpu_kernels" in MODULES  # the check itself: what the old name would hit


def test_evaluate_has_no_sampler_of_its_own():
    """evaluate.py samples with grpo.py's sampler, imported; it defines none of those functions."""
    with open(os.path.join(ROOT, "evaluate.py")) as f:
        defined = {n.name for n in ast.walk(ast.parse(f.read())) if isinstance(n, ast.FunctionDef)}
    assert not defined & {"tokenize_prompts", "filter_logits", "generate", "truncate_response"}


def test_import_plumbing_loads_no_jax():
    """`import plumbing` (and so interop) stays instant: `python dpo.py --help` answers before JAX loads."""
    code = "import sys, plumbing; print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'keras'}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def statements(path):
    """The number of statements (ast.stmt nodes, nested ones included) in a Python file."""
    with open(path) as f:
        return sum(isinstance(node, ast.stmt) for node in ast.walk(ast.parse(f.read())))


def test_statements_count_nested_statements_not_lines(tmp_path):
    """The measure itself: a packed line and its unfolded form count the same; a nested body counts."""
    packed, unfolded = tmp_path / "packed.py", tmp_path / "unfolded.py"
    packed.write_text("a, b = 1, 2\nif a:\n    c = [x for x in (a,\n b)]\n")
    unfolded.write_text(
        "a, b = (\n    1,\n    2,\n)\n\nif a:\n    c = [\n        x\n        for x in (a, b)\n    ]\n"
    )
    assert statements(packed) == statements(unfolded) == 3


@pytest.mark.parametrize("module", sorted(SHARED) + sorted(ABOUT))
def test_statement_budget(module):
    path = os.path.join(ROOT, module + ".py")
    if not os.path.exists(path):
        pytest.skip(f"no {module}.py")
    limit = SHARED[module] if module in SHARED else int(ABOUT[module] * (1 + SLACK))
    assert statements(path) <= limit, f"{module}.py: {statements(path)} statements, budget {limit}"


def test_repository_is_formatted():
    """`ruff format --check` (pyproject.toml's settings) finds nothing to change; .ci/run checks it too."""
    ruff = shutil.which("ruff") or os.path.join(os.path.dirname(sys.executable), "ruff")
    if not os.path.exists(ruff):
        pytest.skip("ruff is not installed (requirements.txt pins it)")
    out = subprocess.run(
        [ruff, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr


# Files held to STYLE's habits below: the algorithm files, evaluate.py, compare.py, the shared modules
CHECKED = (*ALGORITHMS, "grpo_tools", "evaluate", "compare", "common", "plumbing", "interop")


def packing(source):
    """[(line, what)] of the habits a formatter cannot undo: a call passing more than five arguments
    positionally (name them), a literal tuple assignment binding more than two names or any attribute
    (`a, b, c = x, y, z`, `self.a, self.b = ...`), a chained assignment of attributes, a walrus inside a
    tuple, a starred slice with a step (`*x[::2]`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and len(node.args) > 5:
            found.append(
                (node.lineno, f"{ast.unparse(node.func)}(...) passes {len(node.args)} arguments by position")
            )
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
            for target in node.targets:
                names = target.elts if isinstance(target, ast.Tuple) else []
                if len(names) > 2 or any(isinstance(n, ast.Attribute) for n in names):
                    found.append((node.lineno, f"packed assignment: {ast.unparse(target)} = ..."))
        if isinstance(node, ast.Assign) and len(node.targets) > 1:
            if any(isinstance(t, ast.Attribute) for t in node.targets):
                found.append((node.lineno, "chained assignment of attributes"))
        if isinstance(node, ast.Tuple) and any(isinstance(e, ast.NamedExpr) for e in node.elts):
            found.append((node.lineno, "walrus inside a tuple"))
        if isinstance(node, ast.Starred) and isinstance(node.value, ast.Subscript):
            if isinstance(node.value.slice, ast.Slice) and node.value.slice.step is not None:
                found.append((node.lineno, "starred slice with a step"))
    return found


def test_packing_is_found():
    """The check itself, on a line of each kind and on their unfolded forms."""
    packed = "f(a, b, c, d, e, g)\na, b, c = 1, 2, 3\nself.a, b = 1, 2\nself.a = self.b = 0\nx = (y := 1), 2\nf(*k[::2])\n"
    assert sorted(line for line, _ in packing(packed)) == [1, 2, 3, 4, 5, 6]
    unfolded = "f(a, b, c, d, e, g=g)\na, b = 1, 2\nc = 3\nself.a = 1\nx, y = f()\nf(*k)\n"
    assert packing(unfolded) == []


@pytest.mark.parametrize("module", CHECKED)
def test_calls_name_their_arguments_and_nothing_is_packed(module):
    with open(os.path.join(ROOT, module + ".py")) as f:
        found = packing(f.read())
    assert not found, "\n".join(f"{module}.py:{line}: {what}" for line, what in found)


# Functions each script defines for itself by nature, whatever their names share
OWN = {"main", "train_step", "check_args"}


def copies():
    """{function name: {module: its source}} of every top-level function that two or more of the algorithm
    files and evaluate.py define: the deliberate copies (CleanRL's rule: a fork of one file needs no other)."""
    found = {}
    for module in (*ALGORITHMS, "evaluate"):
        with open(os.path.join(ROOT, module + ".py")) as f:
            source = f.read()
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and node.name not in OWN:
                found.setdefault(node.name, {})[module] = ast.get_source_segment(source, node)
    return {name: sources for name, sources in found.items() if len(sources) > 1}


def test_every_deliberate_copy_is_pinned():
    """Every copy of a function is character for character the most common version of it, or says at the copy
    how it differs (`# differs from <script>.py's: ...`): a copy that drifts without saying so fails here."""
    unsaid = []
    for name, sources in sorted(copies().items()):
        versions = [text for text in sources.values()]
        common_text = max(versions, key=versions.count)
        unsaid += [
            f"{m}.py's {name}" for m, t in sources.items() if t != common_text and "# differs from" not in t
        ]
    assert not unsaid, "copies that differ without a '# differs from' comment: " + ", ".join(unsaid)
    names = copies()
    assert {"generate", "filter_logits", "token_logps", "rollout", "lora_off"} <= set(names), sorted(names)
