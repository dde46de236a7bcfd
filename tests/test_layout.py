"""The tree's shape: ruff-formatted and lint-clean, and no two modules import each other."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize(
    "args", [("format", "--check", "."), ("check", ".")], ids=["format", "lint"]
)
@pytest.mark.slow
def test_ruff(args):
    done = ruff(*args)
    assert done.returncode == 0, done.stdout + done.stderr


def package_modules() -> dict[str, Path]:
    """Every module of the distribution by import name, from pyproject's package-dir mapping."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    modules = {}
    for package, folder in config["package-dir"].items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join([package, *(p for p in parts if p != "__init__")])
            # A folder mapped to a subpackage of its own wins over the same files seen from above.
            modules.setdefault(name, path)
    return modules


def test_the_distribution_lists_every_package():
    """setuptools builds only the packages pyproject lists: a folder of modules left off the list
    imports from a checkout but is missing from the wheel."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = set()
    for package, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            folders.add(".".join([package, *init.parent.relative_to(ROOT / folder).parts]))
    assert sorted(folders) == sorted(config["packages"])


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules `name` imports anywhere in its file (function-level imports too)."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            # A package's __init__ is imported by its own modules as a matter of course.
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def test_no_two_modules_import_each_other():
    modules = package_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    pairs = sorted(
        {tuple(sorted((a, b))) for a, deps in graph.items() for b in deps if a in graph[b]}
    )
    assert not pairs, f"modules importing each other: {pairs}"


def test_layers_import_downward_only():
    """kernels/ never imports engine/ or server/; engine/ never imports server/ or the CLI."""
    modules = package_modules()
    rules = {
        "megaslide.kernels": ("megaslide.engine", "megaslide.server", "megaslide.cli"),
        "megaslide.engine": ("megaslide.server", "megaslide.cli"),
    }
    bad = []
    for name, path in modules.items():
        for layer, forbidden in rules.items():
            if name == layer or name.startswith(layer + "."):
                bad += [
                    (name, t) for t in imports_of(name, path, modules) if t.startswith(forbidden)
                ]
    assert not bad, bad


def test_the_dockerfile_builds_what_the_readme_installs():
    """The Dockerfile parses as Docker's own parser reads it, installs the torch the README pins
    (within pyproject.toml's range), copies every folder the package is built from, can start
    from a base without CUDA, and serves."""
    import dockerfile
    from packaging.requirements import Requirement

    commands = dockerfile.parse_file(str(ROOT / "Dockerfile"))
    args = dict(c.value[0].split("=", 1) for c in commands if c.cmd == "ARG" and "=" in c.value[0])
    assert [c.value[0] for c in commands if c.cmd == "FROM"] == ["${BASE_IMAGE}"]
    assert "cuda" in args["BASE_IMAGE"] and "TORCH_INDEX_URL" in args  # CPU: two build args
    readme_pins = set(re.findall(r"pip install torch==([\d.]+)", (ROOT / "README.md").read_text()))
    assert readme_pins == {args["TORCH_VERSION"]}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    [torch] = [r for r in map(Requirement, project["project"]["dependencies"]) if r.name == "torch"]
    assert torch.specifier.contains(args["TORCH_VERSION"])
    installs = " ".join(c.value[0] for c in commands if c.cmd == "RUN")
    assert '"torch==${TORCH_VERSION}"' in installs
    copied = {c.value[0] for c in commands if c.cmd == "COPY"}
    folders = {f.split("/")[0] for f in project["tool"]["setuptools"]["package-dir"].values()}
    assert folders <= copied and "pyproject.toml" in copied
    [cmd] = [c.value for c in commands if c.cmd == "CMD"]
    assert cmd[:2] == ("megaslide", "serve")
