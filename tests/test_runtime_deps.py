"""Every module the running code imports comes with the package's runtime dependencies: users
install moe-cluster without its dev extras (`ray up` setup commands, the Docker image), so a
runtime import of a dev-only package (httpx in `moe-cluster up` once) fails only there."""

import ast
import importlib.metadata as md
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).parent.parent
# the `gpu` extra, imported only where a GPU runs the Triton / FlashMLA kernels (kernels/gpu.py)
OPTIONAL = {"triton", "flash_mla"}
BUILT = {"moe_cpu_kernels"}  # compiled from services/model/kernels/csrc on first use


def runtime_closure(dist: str) -> set[str]:
    """`dist` and every distribution its requirements pull in, transitively, without dev extras
    (a requirement's own extras, like ray[serve], are followed)."""
    seen: set[tuple[str, tuple[str, ...]]] = set()
    todo = [(dist, ())]
    while todo:
        name, extras = todo.pop()
        if (canonicalize_name(name), extras) in seen:
            continue
        seen.add((canonicalize_name(name), extras))
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for req in map(Requirement, requires):
            wanted = req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras or ("",))
            if wanted:
                todo.append((req.name, tuple(sorted(req.extras))))
    return {name for name, _ in seen}


def imported_modules(package: Path, root: Path = ROOT) -> dict[str, str]:
    """Top-level module -> the first file importing it, relative to `root` (absolute imports only)."""
    found: dict[str, str] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(root)))
    return found


def test_every_runtime_import_is_a_runtime_dependency():
    closure = runtime_closure("moe-cluster")
    assert {"torch", "ray", "grpcio", "starlette"} <= closure  # (ray[serve]'s own pulled in)
    providers = md.packages_distributions()
    missing = []
    for module, where in imported_modules(ROOT / "services").items():
        if module in sys.stdlib_module_names or module in OPTIONAL | BUILT or module == "services":
            continue
        dists = {canonicalize_name(d) for d in providers.get(module, [])}
        if not dists & closure:
            missing.append(
                f"{module} (from {sorted(dists) or 'no installed distribution'}, imported by {where})"
            )
    assert missing == [], "runtime imports the runtime dependencies do not install: " + "; ".join(missing)


def test_the_check_sees_a_dev_only_import(tmp_path):
    """Positive control: a module importing httpx (what cluster.py once did) is caught."""
    closure = runtime_closure("moe-cluster")
    assert "httpx" not in closure and "pytest" not in closure and "transformers" not in closure
    (tmp_path / "wait.py").write_text("import json\nimport httpx\nfrom ray import serve\n")
    found = imported_modules(tmp_path, root=tmp_path)
    assert found == {"json": "wait.py", "httpx": "wait.py", "ray": "wait.py"}
    providers = md.packages_distributions()
    unprovided = [m for m in found if m not in sys.stdlib_module_names
                  and not {canonicalize_name(d) for d in providers.get(m, [])} & closure]  # fmt: skip
    assert unprovided == ["httpx"]
