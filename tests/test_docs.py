"""The docs name only what exists (#51): every repository path and results file README.md and
docs/*.md name is in the tree, and README's layout lists the packages under services/ as they are.

Paths are read with regexes, not a Markdown parser: any token (backticked or plain) that starts
with a top-level folder (`services/...`, `benchmarks/...`, `deploy/...`, `docs/...`, `tests/...`,
`proto/...`); a path relative to services/ as the walks in docs/ARCHITECTURE.md write them
(`dataplane/shm.py`, `engine/engine.py`); a bare results file (`attention.json`, `eplb.png`), which
lives in benchmarks/results/; a benchmark module (`bench_dispatch`). Patterns are globbed and must
match something: `{a,b}` is expanded (`{eplb/,policy}.py`: an alternative ending in "/" is a
folder), `*` and `<placeholder>` match anything. A path a command writes (`--out FILE`) is not
checked: it is the command's output, not a claim about the tree.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "benchmarks" / "results"
TOP = ("services", "benchmarks", "deploy", "docs", "tests", "proto")
# Packages directly under services/ (a walk writes `dataplane/shm.py` for services/dataplane/shm.py).
PACKAGES = sorted(p.parent.name for p in (ROOT / "services").glob("*/__init__.py"))

_NOT_AFTER = r"(?<![\w/.~<>*-])"  # not the middle of a longer path, a URL or a home-relative path
REPO_PATH = re.compile(_NOT_AFTER + "((?:" + "|".join(TOP) + r")/[\w./*<>{},-]*)")
SERVICES_PATH = re.compile(_NOT_AFTER + "((?:" + "|".join(PACKAGES) + r")/[\w/{},*<>-]*\.py)(?![\w.])")
RESULT_FILE = re.compile(_NOT_AFTER + r"([\w<>*-]+(?:\.[\w<>*-]+)*\.(?:json|png))(?![\w.])")
BENCH_MODULE = re.compile(r"(?<![\w/.])(bench_[a-z0-9_]+)\b(?!\.json)")
# Bare .json names that are files of a checkpoint, not results.
NOT_RESULTS = {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json"}


def _expand(pattern: str) -> list[str]:
    """`a/{b,c/}.py` -> ["a/b.py", "a/c/"]: braces expanded; an alternative ending in "/" names
    a folder (the suffix after the braces does not apply to it)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    head, tail = pattern[: m.start()], pattern[m.end() :]
    out = []
    for alt in m.group(1).split(","):
        out += [head + alt] if alt.endswith("/") else _expand(head + alt + tail)
    return out


def _exists(path: str, base: Path = ROOT) -> bool:
    pattern = re.sub(r"<[^<>/]*>", "*", path)  # <gpu>, <name>: a placeholder
    if "*" in pattern:
        return any(base.glob(pattern.rstrip("/")))
    return (base / pattern).exists()


def _is_output(text: str, start: int) -> bool:
    """Whether the token at `start` is the file a command writes (`--out FILE`)."""
    return re.search(r"--out[ =]$", text[max(0, start - 6) : start]) is not None


def _tokens(regex: re.Pattern[str]) -> list[tuple[str, int, str]]:
    """(doc, line, token) for every match of `regex` in the docs, trailing punctuation dropped."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in regex.finditer(text):
            if _is_output(text, m.start(1)):
                continue
            token = m.group(1).rstrip(".,;:)")
            if token.count("{") != token.count("}"):  # a brace cut by the regex: stop before it
                token = token[: token.index("{")]
            found.append((doc.relative_to(ROOT).as_posix(), text.count("\n", 0, m.start()) + 1, token))
    return found


def _report(missing: list[str], what: str) -> str:
    return f"{len(missing)} {what} named in the docs but not in the tree:\n  " + "\n  ".join(missing)


def test_the_scan_finds_paths():
    """The regexes see the paths the docs are full of (a regex that matched nothing would pass)."""
    tokens = {t for _, _, t in _tokens(REPO_PATH)}
    assert {"services/dataplane/shm.py", "deploy/cluster.yaml", "tests/faults/"} <= tokens
    assert {"attention.json", "dispatch.json"} <= {t for _, _, t in _tokens(RESULT_FILE)}
    assert "engine/engine.py" in {t for _, _, t in _tokens(SERVICES_PATH)}
    assert not _exists("services/no_such_module.py") and _exists("benchmarks/results/*.json")
    assert _expand("services/balancer/{eplb/,policy}.py") == [
        "services/balancer/eplb/",
        "services/balancer/policy.py",
    ]


def test_every_repository_path_in_the_docs_exists():
    missing = [
        f"{doc}:{line}: {token} ({path})" if path != token else f"{doc}:{line}: {token}"
        for doc, line, token in _tokens(REPO_PATH)
        for path in _expand(token)
        if path.rstrip("/") not in TOP and not _exists(path)
    ]
    assert not missing, _report(missing, "repository paths")


def test_every_path_relative_to_services_exists():
    missing = [
        f"{doc}:{line}: {token} (services/{path})"
        for doc, line, token in _tokens(SERVICES_PATH)
        for path in _expand(token)
        if not _exists(path, ROOT / "services")
    ]
    assert not missing, _report(missing, "paths under services/")


def test_every_results_file_in_the_docs_exists():
    missing = [
        f"{doc}:{line}: {token} (benchmarks/results/{token})"
        for doc, line, token in _tokens(RESULT_FILE)
        if token not in NOT_RESULTS and not _exists(token, RESULTS)
    ]
    assert not missing, _report(missing, "results files")


def test_every_benchmark_module_in_the_docs_exists():
    missing = [
        f"{doc}:{line}: {token} (benchmarks/{token}.py)"
        for doc, line, token in _tokens(BENCH_MODULE)
        if not (ROOT / "benchmarks" / f"{token}.py").exists()
    ]
    assert not missing, _report(missing, "benchmark modules")


def test_deploy_md_lists_files_of_deploy():
    text = (ROOT / "docs" / "deploy.md").read_text()
    table = text.split("The files are in `deploy/`", 1)[1].split("\n\n", 2)[1]
    names = [n for row in table.splitlines()[2:] for n in re.findall(r"`([^`\s]+)`", row.split("|")[1])]
    assert names, "docs/deploy.md: no table of deploy/'s files"
    missing = [f"deploy/{n}" for n in names if not (ROOT / "deploy" / n).exists()]
    assert not missing, _report(missing, "deploy files")


def _readme_layout() -> str:
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Layout\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "README.md has no '## Layout' section"
    block = re.search(r"^```\n(.*?)^```", section.group(1), re.S | re.M)
    assert block, "README.md's layout section has no code block"
    return block.group(1)


def test_readme_layout_lists_the_packages_under_services():
    layout = _readme_layout()
    listed = re.findall(r"^services/(\w+)/", layout, re.M)
    assert sorted(listed) == PACKAGES, (
        f"README.md's layout lists services/{{{','.join(sorted(listed))}}}, "
        f"the tree has services/{{{','.join(PACKAGES)}}}"
    )
    nested = sorted(
        p.parent.relative_to(ROOT / "services").as_posix()
        for p in (ROOT / "services").glob("*/*/__init__.py")
    )
    unnamed = [f"services/{p}/" for p in nested if f"{p.split('/')[1]}/" not in layout]
    assert not unnamed, f"README.md's layout does not name these packages: {unnamed}"
    modules = sorted(p.name for p in (ROOT / "services").glob("*.py") if p.name != "__init__.py")
    unnamed = [f"services/{m}" for m in modules if not re.search(rf"(?<![\w/]){re.escape(m)}", layout)]
    assert not unnamed, f"README.md's layout does not name these top-level modules: {unnamed}"


def test_readme_starts_with_make_run_and_make_test():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"^```\w*\n(.*?)^```", text, re.S | re.M)
    assert block and block.start() == text.index("```"), "README.md has no command block"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    assert commands[:2] == ["make run", "make test"], f"README.md's first commands: {commands}"
    assert text.index("```") < text.index("\n## "), "the commands must come before the first section"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^run:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
