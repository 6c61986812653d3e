"""The repository's shape: separate venvs, no imports across services, CI runs the README's command."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENVS = ROOT / ".venvs"


def imported_top_levels(package_dir: Path) -> set[str]:
    names = set()
    for path in package_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize(
    "package, forbidden",
    [
        ("protocol/src/protocol", {"rollout_svc", "trainer_svc", "torch", "vllm", "transformers"}),
        ("rollout_svc/src/rollout_svc", {"trainer_svc"}),
        ("trainer_svc/src/trainer_svc", {"rollout_svc", "vllm"}),
    ],
)
def test_services_never_import_each_other(package, forbidden):
    assert imported_top_levels(ROOT / package) & forbidden == set()


@pytest.mark.parametrize(
    "venv, importable, absent",
    [("rollout", "rollout_svc", "trainer_svc"), ("trainer", "trainer_svc", "rollout_svc")],
)
def test_each_venv_holds_its_service_and_protocol_only(venv, importable, absent, tmp_path):
    # Run outside the repository, where the source folders would import as namespace packages.
    python = VENVS / venv / "bin" / "python"
    ok = subprocess.run([python, "-c", f"import protocol, {importable}"], capture_output=True, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr.decode()
    missing = subprocess.run([python, "-c", f"import {absent}"], capture_output=True, cwd=tmp_path)
    assert missing.returncode != 0


def test_make_venvs_is_idempotent():
    # `make -q` exits 0 only when every target is up to date: a second run would do nothing.
    assert subprocess.run(["make", "-q", "venvs"], cwd=ROOT).returncode == 0


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^\s*(make \w+)\s*$", readme, flags=re.M)
    assert "make test" in commands and "make demo" in commands
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, flags=re.M)


def module_imports(package_dir: Path) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports, anywhere in its code (lazy imports
    inside functions included): `from . import x`, `from .x import y`, `import pkg.x`."""
    package = package_dir.name
    modules = {
        ".".join(path.relative_to(package_dir).with_suffix("").parts).removesuffix(".__init__"): path
        for path in package_dir.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name.split(".") if is_package else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                if not node.level and (node.module or "").split(".")[0] != package:
                    continue
                target = base + (node.module.split(".") if node.module else [])
                if not node.level:
                    target = target[1:]
                candidates = [".".join(target + [alias.name]) for alias in node.names] + [".".join(target)]
                found.update(c for c in candidates if c in modules and c != name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == package and ".".join(parts[1:]) in modules:
                        found.add(".".join(parts[1:]))
        graph[name] = found - {""}
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, as a path that ends where it starts; None when there is none."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, ())):
            cycle = visit(nxt, path + [node])
            if cycle:
                return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start, [])
        if cycle:
            return cycle
    return None


@pytest.mark.parametrize(
    "package", ["protocol/src/protocol", "rollout_svc/src/rollout_svc", "trainer_svc/src/trainer_svc"]
)
def test_no_module_imports_one_that_imports_it(package):
    graph = module_imports(ROOT / package)
    assert len(graph) > 5 and any(graph.values())  # the scan found the modules and their imports
    assert import_cycle(graph) is None


# The trainer's parts, lowest first. A module imports from its own part, from the parts below it and
# from the shared modules at the package's top (config, data, distributed, records, rollout_types),
# never from a part above it; the shared modules import no part, and only the CLI may import any.
TRAINER_PARTS = ("weights", "learning", "rollout", "envs", "tasks", "rails", "run")
# Shared modules that are packages (one module per group of config sections): shared, not parts.
SHARED_PACKAGES = ("config",)


def imports_up(graph: dict[str, set[str]], parts: tuple[str, ...]) -> list[str]:
    """The imports of `graph` that go up the order of `parts` ("importer -> imported")."""

    def level(module: str) -> int:
        head = module.split(".")[0]  # a part's own __init__ ("envs") is of the part
        return parts.index(head) if head in parts else -1  # a shared top-level module: below every part

    return sorted(f"{a} -> {b}" for a, found in graph.items() if a != "cli" for b in found if level(b) > level(a))


def test_the_trainers_parts_import_only_downwards():
    graph = module_imports(ROOT / "trainer_svc/src/trainer_svc")
    sub_packages = {m.split(".")[0] for m in graph if "." in m}
    assert sub_packages == set(TRAINER_PARTS) | set(SHARED_PACKAGES)  # every sub-package has its place
    assert imports_up(graph, TRAINER_PARTS) == []


def test_the_docs_table_of_the_trainers_parts_matches_the_tree():
    layout = (ROOT / "docs" / "layout.md").read_text()
    table = layout.split("| part | modules | what it does |\n", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| (shared|`\w+/`) \| ([^|]+) \|", table, flags=re.M)
    listed = {part.strip("`/"): set(re.findall(r"`(\w+)`", modules)) for part, modules in rows}
    package = ROOT / "trainer_svc/src/trainer_svc"
    tree = {
        part.name: {p.stem for p in part.glob("*.py") if p.stem != "__init__"}
        for part in package.iterdir()
        if (part / "__init__.py").exists() and part.name not in SHARED_PACKAGES
    }
    tree["shared"] = {p.stem for p in package.glob("*.py") if p.stem != "__init__"} | set(SHARED_PACKAGES)
    assert listed == tree
    assert [part for part, _ in rows[1:]] == [f"`{part}/`" for part in TRAINER_PARTS]  # in the order of the parts


def test_an_import_up_the_parts_is_found():
    graph = {"weights.a": {"run.b", "config"}, "run.b": {"weights.a"}, "config": {"rails.c"}, "cli": {"run.b"}}
    assert imports_up(graph, TRAINER_PARTS) == ["config -> rails.c", "weights.a -> run.b"]


def test_the_cycle_finder_finds_a_lazy_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub.b import thing\n")
    (pkg / "sub" / "b.py").write_text("def thing():\n    from ..a import x\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = module_imports(pkg)
    assert graph["a"] == {"sub.b"} and graph["sub.b"] == {"a"} and graph["c"] == {"a"}
    assert import_cycle(graph) in (["a", "sub.b", "a"], ["sub.b", "a", "sub.b"])
