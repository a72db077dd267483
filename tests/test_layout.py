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
SHARED = {"common": 700, "plumbing": 700, "interop": 300}
ABOUT = {
    "dpo": 250,
    "simpo": 250,
    "orpo": 250,
    "kto": 250,
    "sft": 220,
    "reward": 220,
    "ppo": 380,
    "grpo": 380,
    "rloo": 380,
    "distill": 290,
    "evaluate": 300,
    "compare": 560,
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
    assert graph["common"] == {"interop"}, graph["common"]  # never the shell
    assert graph["plumbing"] <= {"common", "interop"}, graph["plumbing"]
    users = [m for m in (*ALGORITHMS, "evaluate", "compare") if "interop" in graph.get(m, ())]
    assert not users, f"{', '.join(users)} import interop (reach it through common or plumbing)"


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
