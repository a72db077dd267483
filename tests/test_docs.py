"""The docs against the code, by reading files only (no JAX import, no subprocess): docs/code.md's
loop is dpo.py's, the README's commands name scripts and flags that exist (and mark the lines that need
weights or a network), nothing cites a design document outside the repository, every backticked
`common.NAME` / `plumbing.NAME` / `interop.NAME` names something those modules define, every
pointer into docs/design.md names one of its sections, and every comparison number a page quotes is one the
committed run (docs/comparison_run/) holds."""

import ast
import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_DIRS = {"runs", "__pycache__", "node_modules"}  # plus every dot-directory (.git, .venv, …)
SECTIONS = (
    "Files",
    "Flags",
    "Outputs",
    "Lifecycle",
    "Mesh",
    "FLOPs",
    "Metrics",
    "Sampling",
    "Compilation cache",
)


def read(*path):
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return f.read()


def repo_files(exts=(".py", ".md", ".sh")):
    """The repository's own files with these endings (what `git ls-files` lists, and untracked ones)."""
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
        for name in sorted(files):
            if name.endswith(exts):
                yield os.path.relpath(os.path.join(top, name), ROOT)


def doc_files():
    return ["README.md"] + sorted(
        os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")
    )


def module_names(path):
    """{top-level name: the names its class body defines, or None} of a module, from its source:
    defs, classes, assignments and imports, also inside top-level if/try/with/for blocks."""
    names = {}

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names[node.name] = None
            elif isinstance(node, ast.ClassDef):
                names[node.name] = class_names(node) if not node.bases else None  # bases: inherited too
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            names[n.id] = None
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    names[(a.asname or a.name).split(".")[0]] = None
            for field in ("body", "orelse", "finalbody", "handlers"):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(getattr(node, field, []))

    visit(ast.parse(read(path)).body)
    return names


def class_names(cls):
    """Methods, class attributes and `self.x = …` attributes of a class."""
    out = {
        n.attr
        for n in ast.walk(cls)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Store)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    }
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Assign):
            out.update(n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return out


def test_code_page_loop_is_dpo_main():
    """docs/code.md's loop snippet is dpo.py's main, line for line (a subset, in order)."""
    blocks = [
        b
        for b in re.findall(r"```python\n(.*?)```", read("docs", "code.md"), re.S)
        if "for step in run.steps(" in b
    ]
    assert len(blocks) == 1, f"docs/code.md: {len(blocks)} python blocks hold `for step in run.steps(`"
    source = [line.strip() for line in read("dpo.py").splitlines()]
    at = -1
    for line in (s.strip() for s in blocks[0].splitlines()):
        if not line:
            continue
        following = [i for i in range(at + 1, len(source)) if source[i] == line]
        assert following, f"docs/code.md's loop snippet: {line!r} is not in dpo.py after line {at + 1}"
        at = following[0]


def readme_commands():
    """(script path, its flags, the line's comment) of every `python <file>.py …` line in the README's bash
    blocks, continuation lines joined."""
    import shlex

    for block in re.findall(r"```bash\n(.*?)```", read("README.md"), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command, _, comment = line.partition("  #")
            words = shlex.split(command)
            if words[:1] == ["python"] and words[1].endswith(".py"):
                yield words[1], [w.split("=")[0] for w in words[2:] if w.startswith("--")], comment


def test_readme_commands_name_flags_that_exist():
    """Each README command runs a file of the repository with flags its `Args` has (read from source, as --help
    reads it); a line that needs what a fresh clone offline lacks (a real model's weights, the network) says so
    in its comment: every `--model` other than `tiny` or a run's `runs/…/model` is marked `real model`."""
    import plumbing  # instant: no JAX

    commands = list(readme_commands())
    assert len(commands) >= 10, commands
    for path, flags, comment in commands:
        assert os.path.exists(os.path.join(ROOT, path)), path
        ours = {"--" + name.replace("_", "-") for name in plumbing._fields(os.path.join(ROOT, path), "Args")}
        assert set(flags) <= ours | {"--help"}, (path, set(flags) - ours)
    for block in re.findall(r"```bash\n(.*?)```", read("README.md"), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            model = re.search(r"--model (\S+)", line)
            if model and model.group(1) != "tiny" and not model.group(1).startswith("runs/"):
                assert "# real model" in line, line
            if "data/gsm8k.py --out" in line:
                assert "needs network" in line, line


def test_relative_links_resolve():
    """Every relative link of README.md and docs/*.md names a file of the repository, and its `#anchor` one of
    that file's headings (GitHub's slugs: lower case, punctuation dropped, spaces as hyphens)."""

    def slugs(path):
        return {
            re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", read(path), flags=re.S), re.M)
        }

    bad = []
    for path in doc_files():
        for target in re.findall(r"\]\(([^)\s]+)\)", read(path)):
            if "://" in target:
                continue
            file, _, anchor = target.partition("#")
            linked = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            if not os.path.exists(os.path.join(ROOT, linked)):
                bad.append(f"{path}: {target}")
            elif anchor and linked.endswith(".md") and anchor not in slugs(linked):
                bad.append(f"{path}: {target} (no such heading)")
    assert not bad, "links to nothing:\n" + "\n".join(bad)


def test_no_external_design_citations():
    marker = "DESIGN" + " §"  # spelled apart, so this file does not match itself
    hits = [
        f"{path}:{i}"
        for path in repo_files()
        for i, line in enumerate(read(path).splitlines(), 1)
        if marker in line
    ]
    assert not hits, f"{marker} (a document outside the repository) cited at: {', '.join(hits)}"


def test_backticked_module_names_exist():
    """`common.X`, `plumbing.X`, `interop.X` (and `plumbing.Run.x`: a method of a class without bases)."""
    modules = {m: module_names(m + ".py") for m in ("common", "plumbing", "interop")}
    bad = []
    for path in doc_files():
        text = re.sub(r"```.*?```", "", read(path), flags=re.S)  # fenced code: test_readme_loop_is_dpo_main
        for span in re.findall(r"`([^`\n]+)`", text):
            for module, name, attr in re.findall(r"\b(common|plumbing|interop)\.(\w+)(?:\.(\w+))?", span):
                if name == "py":  # the file itself
                    continue
                names = modules[module]
                if name not in names:
                    bad.append(f"{path}: `{module}.{name}`")
                elif attr and names[name] is not None and attr not in names[name]:
                    bad.append(f"{path}: `{module}.{name}.{attr}`")
    assert not bad, "names the shared modules do not define:\n" + "\n".join(sorted(set(bad)))


def test_design_sections_and_pointers():
    """docs/design.md has the sections others point at, and every `docs/design.md, Section` names one."""
    headings = re.findall(r"^## (.+?)\s*$", read("docs", "design.md"), re.M)
    assert list(headings) == list(SECTIONS), headings
    pointer = re.compile(r'design\.md\)?(?:,\s*|\s\()"?([A-Z][\w ]*?)"?\s*[)\];:.,\n]')
    bad = [
        f"{path}: {part!r}"
        for path in repo_files()
        for found in pointer.findall(read(path))
        for part in found.split(" and ")
        if part not in SECTIONS
    ]
    assert not bad, "pointers into docs/design.md that name no section of it:\n" + "\n".join(bad)


def test_coming_from_trl_names_flags_that_exist():
    """docs/trl.md's "Coming from TRL" table: each flag it gives as this project's is a field of some script's
    Args (read from source, as --help reads it), and each TRL name beside it is either that same flag here
    (TRL's underscores for our dashes) or one plumbing.TRL_FLAGS answers with a hint."""
    import plumbing  # instant: no JAX

    scripts = ("sft", "dpo", "simpo", "orpo", "kto", "reward", "ppo", "grpo", "rloo", "distill", "evaluate")
    ours = {
        "--" + name.replace("_", "-")
        for s in scripts
        for name in plumbing._fields(os.path.join(ROOT, s + ".py"), "Args")
    }
    section = read("docs", "trl.md").split("## Coming from TRL")[1].split("\n## ")[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| `--")]
    assert len(rows) >= 15
    for trl, here in rows:
        trl = ["--" + t.replace("_", "-") for t in re.findall(r"--([a-z][a-z0-9_]*)", trl)]
        here = re.findall(r"--[a-z][a-z0-9-]*", here)
        assert trl and all(f in ours for f in here), (trl, here)
        if not here:  # "the same, with dashes"
            assert all(t in ours for t in trl), trl
        assert all(t in ours or t[2:] in plumbing.TRL_FLAGS for t in trl), trl


RUN = os.path.join("docs", "comparison_run")  # the comparison's committed artefacts: one run, every number
NUMBER = re.compile(r"(?<![\w.])[+\-−]?(\d+\.\d+(?:e[+-]?\d+)?)")  # a decimal (the sign dropped)
PAIR = re.compile(r"(?<![\w.])[+\-−]?(\d+\.\d+) ± (\d+\.\d+)")  # a value and its interval: one number


def run_numbers():
    """Every decimal the committed run holds as a page would quote it: the numbers of its report (compare.py's
    comparison.md: the summary, the table, the Δ matrix), and from results.json the eval curves' scores (3
    decimals) and each run's FLOPs (as 1.23e12); nothing else, so that a wrong digit rarely passes."""
    report = read(RUN, "comparison.md")
    held = set(NUMBER.findall(report)) | {" ± ".join(p) for p in PAIR.findall(report)}
    results = json.loads(read(RUN, "results.json"))
    held.update(f"{p[1]:.3f}" for curves in results["curves_eval"].values() for c in curves for p in c)
    held.update(f"{r['flops']:.2e}".replace("e+", "e") for r in results["runs"].values())
    return held


def quoted(text):
    """[(line number, line)] inside the page's `<!-- numbers: docs/comparison_run -->` … `<!-- end numbers -->`
    blocks: where a page quotes the comparison."""
    out, inside = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("<!-- numbers:"):
            inside = True
        elif line.strip().startswith("<!-- end numbers"):
            inside = False
        elif inside:
            out.append((i, line))
    return out


def numbers(line):
    """The decimals of a line, a value with its interval (`0.065 ± 0.015`) as one: the pair must be the run's."""
    return [" ± ".join(p) for p in PAIR.findall(line)] + NUMBER.findall(PAIR.sub(" ", line))


def unheld(path, text, held):
    """["path:line: what"] for each decimal inside a numbers block that `held` lacks, and each line outside a
    block that points at docs/comparison.md and quotes a decimal (docs/comparison.md itself: blocks only)."""
    blocks = quoted(text)
    inside = {i for i, _ in blocks}
    bad = [f"{path}:{i}: {n}" for i, line in blocks for n in numbers(line) if n not in held]
    for i, line in enumerate(text.splitlines(), 1):
        cites = "comparison.md" in line and path != os.path.join("docs", "comparison.md")
        if cites and i not in inside and NUMBER.search(line):
            bad.append(f"{path}:{i}: a comparison number outside a numbers block")
    return bad


def test_comparison_numbers_come_from_the_committed_run():
    """One source of numbers: every decimal that README.md or a docs page quotes from the comparison (inside a
    numbers block) is one the committed run's artefacts hold; a line outside such a block that points at
    docs/comparison.md does not quote a decimal; docs/comparison.md has a block; the artefacts name their
    command."""
    held = run_numbers()
    results = json.loads(read(RUN, "results.json"))
    bad = [b for path in doc_files() for b in unheld(path, read(path), held)]
    assert quoted(read("docs", "comparison.md")), "docs/comparison.md quotes no numbers block"
    assert results["command"].startswith("python compare.py") and results["rows"], RUN
    assert not bad, "numbers the committed run does not hold:\n" + "\n".join(bad)


def test_number_check_catches_a_number_the_run_lacks():
    """The check itself: a decimal inside a block is looked up (its sign dropped; a value with its interval as
    one pair), one outside is not, and a line outside a block that cites docs/comparison.md with a decimal is
    flagged."""
    page = (
        "a 0.123 b\n<!-- numbers: docs/comparison_run -->\nΔ −0.045 ± 0.017, 3.31e12 FLOPs\n"
        "<!-- end numbers -->\nGRPO +0.05 (docs/comparison.md)\n"
    )
    assert [n for _, line in quoted(page) for n in numbers(line)] == ["0.045 ± 0.017", "3.31e12"]
    assert unheld("docs/x.md", page, {"0.045 ± 0.017", "3.31e12"}) == [
        "docs/x.md:5: a comparison number outside a numbers block"
    ]
    # each half held, but not as a pair: the interval belongs to another cell
    assert unheld("docs/x.md", page, {"0.045", "0.017", "3.31e12"})[0] == "docs/x.md:3: 0.045 ± 0.017"
