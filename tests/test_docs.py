"""The docs against the code, by reading files only (no JAX import, no subprocess): docs/code.md's
loop is dpo.py's, the README's commands name scripts and flags that exist (and mark the lines that need
weights or a network), nothing cites a design document outside the repository, every backticked
`common.NAME` / `plumbing.NAME` / `interop.NAME` names something those modules define, every
pointer into docs/design.md names one of its sections, and every number a page quotes from a committed run
(docs/comparison_run/, docs/grpo_tools_run/) is that run's own cell for it."""

import ast
import json
import os
import re
import sys

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


# A page quotes a committed run inside `<!-- numbers: FOLDER -->` … `<!-- end numbers -->`, and each number it
# quotes there is tied to one cell of that run's artefacts: in a table, the cell of the run's report at the
# same row and column; elsewhere (or to override a table's binding), by a tag right after the number,
# `<!--ROW :: COLUMN-->` (a report cell) or `<!--json:a/b/0-->` (a path into the run's JSON, or into another
# JSON file of the run's folder when the path starts with its name, `json:claims.json/…`; shown at the quoted
# number's decimals; a [mean, ±] pair as "mean ± half"). A number that is right for another cell fails. A block
# may name a JSON file instead of a folder (an earlier run's report.json): its numbers are tagged, every one.
SOURCES = {  # FOLDER -> (its report: markdown tables, its JSON)
    os.path.join("docs", "comparison_run"): ("comparison.md", "results.json"),
    os.path.join("docs", "grpo_tools_run"): ("report.md", "report.json"),
}
NUMBER = re.compile(
    r"(?<![\w.])([+\-−]?\d+\.\d+(?:e[+-]?\d+)?)(?: ± (\d+\.\d+))?"
)  # a value [± its interval]
TAG = re.compile(r"<!--(.*?)-->")


def norm(match):
    """A quoted number as compared: its sign kept ("−" as "-", "+" dropped), with its interval if given."""
    v = match.group(1).replace("−", "-").lstrip("+")
    return f"{v} ± {match.group(2)}" if match.group(2) else v


def cell_values(text):
    return [norm(m) for m in NUMBER.finditer(TAG.sub(" ", text))]


def cells(text):
    """{(row, column): [each table cell's values]} of every markdown table of a page (bold dropped)."""
    out, header = {}, None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        parts = [c.strip().strip("*").strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = parts
        elif not set(line) <= set("|-: "):
            for column, cell in zip(header[1:], parts[1:]):
                out.setdefault((parts[0], column), []).extend(cell_values(cell))
    return out


def source(folder):
    """A run's cells and its JSON; a JSON file alone (an earlier run's report.json): no cells, its JSON."""
    if folder.endswith(".json"):
        return {}, json.loads(read(folder))
    report, data = SOURCES[folder]
    return cells(read(folder, report)), json.loads(read(folder, data))


def from_json(data, path, like, folder=None):
    """The value at `path` of a run's JSON (of `folder`'s file named by its first part, if a .json), written
    as the quoted number `like` is (its decimals, e-form)."""
    node, keys = data, path.split("/")
    if keys[0].endswith(".json"):  # beside the source (a folder's file, or a file's neighbour)
        node, keys = (
            json.loads(read(os.path.dirname(folder) if folder.endswith(".json") else folder, keys[0])),
            keys[1:],
        )
    while keys:  # a key may hold a slash itself ("correct/all"): the shortest run of parts that is one
        n = next(
            (n for n in range(1, len(keys) + 1) if isinstance(node, dict) and "/".join(keys[:n]) in node), 1
        )
        key, keys = "/".join(keys[:n]), keys[n:]
        node = node[int(key)] if isinstance(node, list) else node[key]
    digits = len(like.split(" ± ")[0].split("e")[0].split(".")[1])
    form = f".{digits}e" if "e" in like else f".{digits}f"
    show = lambda x: format(x, form).replace("e+", "e")
    return f"{show(node[0])} ± {show(node[1])}" if isinstance(node, list) else show(node)


def untied(path, text):
    """["path:line: what"] for each number inside a numbers block that is not its own cell's, and each line
    outside a block that points at a quoted page (comparison.md, grpo_tools.md#results) and quotes a decimal."""
    bad, folder, header = [], None, None
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("<!-- numbers:"):
            folder = line.split("numbers:")[1].split("-->")[0].strip()
            table, data = source(folder)
            continue
        if line.strip().startswith("<!-- end numbers"):
            folder = None
            continue
        if folder is None:
            cites = ("comparison.md" in line and path != os.path.join("docs", "comparison.md")) or (
                "grpo_tools.md#results" in line or "grpo_tools.md, Results" in line
            )
            if cites and NUMBER.search(line):
                bad.append(f"{path}:{i}: a quoted number outside a numbers block")
            continue
        parts = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else [line]
        if not line.startswith("|"):
            header = None
        elif header is None or set(line) <= set("|-: "):
            header = header or [c.strip("*").strip() for c in parts]
            continue
        for k, part in enumerate(parts):
            for m in NUMBER.finditer(part):
                tag = TAG.match(part, m.end())
                if tag:
                    key = tag.group(1).strip()
                    if key.startswith("json:"):
                        try:
                            want = [from_json(data, key[5:], norm(m), folder)]
                        except (KeyError, IndexError, TypeError, ValueError):
                            want = []
                    else:
                        want = table.get(tuple(x.strip() for x in key.split("::", 1)), [])
                elif line.startswith("|") and k > 0:
                    want = table.get((parts[0].strip("*").strip(), header[k]), [])
                else:
                    bad.append(f"{path}:{i}: {norm(m)} names no cell (a tag after it)")
                    continue
                if norm(m) not in want:
                    bad.append(
                        f"{path}:{i}: {norm(m)} is not its cell's ({', '.join(want) or 'no such cell'})"
                    )
    return bad


def test_quoted_numbers_are_their_own_cells_of_the_committed_runs():
    """One source of numbers: every number README.md or a docs page quotes from a committed run (inside a
    numbers block) is the run's own cell for it, by row and column or by its tag; a line outside a block that
    points at a quoted page does not quote a decimal; the quoted pages have blocks; the artefacts name their
    command."""
    bad = [b for path in doc_files() for b in untied(path, read(path))]
    assert "<!-- numbers: docs/comparison_run -->" in read("docs", "comparison.md")
    assert "<!-- numbers: docs/grpo_tools_run -->" in read("docs", "grpo_tools.md")
    assert "<!-- numbers: docs/grpo_tools_run -->" in read("README.md")
    assert json.loads(read("docs", "comparison_run", "results.json"))["command"].startswith(
        "python compare.py"
    )
    assert not bad, "numbers that are not their own cells:\n" + "\n".join(bad)


def test_the_number_check_ties_each_number_to_its_own_cell(monkeypatch):
    """The check itself, on a made-up run: a table's number is its report's cell at the same row and column
    (another cell's value fails, its sign too); prose needs a tag, and a tagged number must be that cell's or
    that JSON value; a number outside a block on a line citing a quoted page is flagged."""
    report = (
        "| row | a | b |\n|---|---:|---:|\n| x | 0.100 ± 0.010 | -0.200 |\n| y | 0.300 | 0.100 ± 0.010 |\n"
    )
    monkeypatch.setitem(SOURCES, "run", ("r.md", "r.json"))
    monkeypatch.setattr(
        sys.modules[__name__],
        "source",
        lambda folder: (cells(report), {"k": [0.1234, 0.05], "n": [1.5e12], "a/b": {"c": 0.25}}),
    )
    block = lambda body: f"<!-- numbers: run -->\n{body}\n<!-- end numbers -->\n"
    ok = block(
        "| row | b |\n|---|---:|\n| **x** | −0.200 |\nx: +0.100 ± 0.010<!--x :: a--> and 0.12 ± 0.05<!--json:k-->, 1.5e12<!--json:n/0-->"
    )
    assert untied("docs/p.md", ok) == []
    assert untied("docs/p.md", block("| row | a |\n|---|---:|\n| y | 0.100 ± 0.010 |")) == [
        "docs/p.md:4: 0.100 ± 0.010 is not its cell's (0.300)"  # x's value, quoted in y's row
    ]
    assert untied("docs/p.md", block("| row | b |\n|---|---:|\n| x | 0.200 |"))[0].endswith("(-0.200)")
    assert untied("docs/p.md", block("y is 0.300")) == ["docs/p.md:2: 0.300 names no cell (a tag after it)"]
    assert untied("docs/p.md", block("y is 0.300<!--x :: b-->")) == [
        "docs/p.md:2: 0.300 is not its cell's (-0.200)"
    ]
    assert untied("docs/p.md", block("0.13<!--json:k/0-->")) == ["docs/p.md:2: 0.13 is not its cell's (0.12)"]
    assert untied("docs/p.md", block("0.25<!--json:a/b/c-->")) == []  # a key with a slash in it
    assert untied("README.md", "GRPO +0.05 (docs/comparison.md)\n") == [
        "README.md:1: a quoted number outside a numbers block"
    ]


def test_seed_means_is_a_t_over_the_seed_means_worked_by_hand():
    """claims.seed_means on 3 seeds whose Δs average 0.1, 0.2, 0.3 over the prompts: t = 0.2 / (0.1 / √3)
    = 2√3 with 2 df, whose upper tail is 1/2 − t / (2√(t² + 2)) = 1/2 − √3/√14 = 0.03709 ("above"),
    0.96291 ("below"); neither holds at 0.025, even alone."""
    import numpy as np

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import claims

    prompts = np.array([-0.05, 0.0, 0.05])  # each seed's prompts spread around its mean
    scores = {f"a/seed{s}|score": m + prompts for s, m in enumerate([0.6, 0.7, 0.8])}
    scores |= {f"b/seed{s}|score": np.full(3, 0.5) for s in range(3)}
    both = {f"a − b (greedy) {side}": {"of": ["a", "b", "score", side]} for side in ("above", "below")}
    out = claims.seed_means({"seeds": [0, 1, 2]}, scores, both)
    want = 0.5 - np.sqrt(3) / np.sqrt(14)
    np.testing.assert_allclose(list(out["p"].values()), [want, 1 - want])
    assert abs(want - 0.03709) < 1e-5 and out["holds"] == []


def test_the_committed_claims_and_intervals_recompute_from_the_per_prompt_scores():
    """What the pages quote is what the per-prompt arrays give: docs/comparison_run/claims.json is
    benchmarks/claims.py's family (every claim, one Holm) of scores.npz, and the tools run's intervals, Δs and
    claims are its scores.npz's (compare_stats', seeds and prompts random)."""
    import numpy as np

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import claims

    from compare_stats import holm, mean_interval, p_above_zero

    run = os.path.join(ROOT, "docs", "comparison_run")
    saved = json.loads(read("docs", "comparison_run", "claims.json"))
    results = json.loads(read("docs", "comparison_run", "results.json"))
    per_prompt = np.load(os.path.join(run, "scores.npz"))
    again = claims.family(results, per_prompt)
    assert again.keys() == saved["claims"].keys() and len(again) == saved["family"] == 152
    for k, v in again.items():
        assert v["holds"] == saved["claims"][k]["holds"], k
        np.testing.assert_allclose(
            v["delta"] + [v["p"]], saved["claims"][k]["delta"] + [saved["claims"][k]["p"]]
        )
    assert claims.at_equal_flops(results) == saved["equal_flops"]
    fixed = claims.seed_means(results, per_prompt, again)
    assert fixed["holds"] == saved["seed_means"]["holds"]
    np.testing.assert_allclose(list(fixed["p"].values()), list(saved["seed_means"]["p"].values()))

    report = json.loads(read("docs", "grpo_tools_run", "report.json"))
    scores = np.load(os.path.join(ROOT, "docs", "grpo_tools_run", "scores.npz"))
    for row, cells in report["rows"].items():
        np.testing.assert_allclose(mean_interval(scores[f"{row}/correct"]), cells["correct/all"])
    ps = {}
    for name, cells in report["deltas"].items():
        a, b = name.split(" - ")
        d = scores[f"{a}/correct"] - scores[f"{b}/correct"]
        np.testing.assert_allclose(mean_interval(d), cells["correct/all"])
        ps.update({f"{name} above": p_above_zero(d), f"{name} below": p_above_zero(-d)})
    assert list(ps) == list(report["claims"])
    assert holm(list(ps.values()), 0.025) == [c["holds"] for c in report["claims"].values()]
    assert [c for c, v in report["claims"].items() if v["holds"]] == [
        "grpo + tools - grpo, no tools (control) above"
    ]
