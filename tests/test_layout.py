"""The layout's rules, checked on the source: the layers show, and nothing reaches around them.

No import cycle (imports inside functions count too); every import points down the declared
order of layers (:data:`LAYERS`); at most eight modules at the package's top level; package
``__init__`` files are docstrings only (but the config's, which is its public face); no module
is over 500 lines; the controller stays under 400 lines; and every caller of a rollout uses
only the :class:`~asyncrl.rollout.interface.Rollout` interface.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from asyncrl.episodes.rollout import EpisodeRollout
from asyncrl.rollout.completions import CompletionRollout
from asyncrl.rollout.interface import Rollout

PACKAGE = Path(__file__).resolve().parent.parent / "asyncrl"

# The layers, bottom first: a module may import its own layer's modules and any layer below,
# never one above (a prefix names a package or a module). The bottom holds what every layer
# needs; the application (the built-in toy world, which trains its warm starts, and the
# command line) sits on top. Lower layers reach the built-in tasks, rewards, environments and
# models through their registries (asyncrl/plugins.py), never by importing them.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("asyncrl.errors", "asyncrl.lifeline", "asyncrl.plugins"),
    ("asyncrl.types",),
    ("asyncrl.config",),
    ("asyncrl.protocol", "asyncrl.reports"),
    ("asyncrl.algorithms",),
    ("asyncrl.models",),
    ("asyncrl.checkpoints",),
    ("asyncrl.prompts",),
    ("asyncrl.trainer",),
    ("asyncrl.transports",),
    ("asyncrl.engine",),
    ("asyncrl.rewards",),
    ("asyncrl.rollout",),
    ("asyncrl.episodes",),
    ("asyncrl.server",),
    ("asyncrl.distill",),
    ("asyncrl.workers",),
    ("asyncrl.runtimes",),
    ("asyncrl.control",),
    ("asyncrl.features",),
    ("asyncrl.builtin",),
    ("asyncrl.cli", "asyncrl"),
)


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The asyncrl modules ``name`` imports anywhere in its file (functions included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor) + (f".{base}" if base else "")
            # ``from package import module`` imports the module; ``from module import name`` the module
            candidates = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate.startswith("asyncrl") and candidate != name:
                targets.add(candidate)
    return targets


def test_no_module_imports_itself_around_a_cycle() -> None:
    known = modules()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    cycles = []

    def reach(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo += graph[node]
        return seen

    for name in graph:
        if name in reach(name):
            cycles.append(name)
    assert cycles == [], f"modules on an import cycle: {sorted(cycles)}"


def layer_of(name: str) -> int:
    """The index in :data:`LAYERS` of the longest prefix naming ``name``."""
    best, depth = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = index, prefix.count(".")
    assert best is not None, f"{name} is in no layer: add it to LAYERS"
    return best


def test_every_import_points_down_the_layers() -> None:
    known = modules()
    upward = sorted(
        f"{name} -> {target}"
        for name, path in known.items()
        for target in imported(name, path, known)
        if layer_of(target) > layer_of(name)
    )
    assert upward == [], "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_the_layer_check_sees_an_upward_import() -> None:
    """The check itself: a low module importing a high one is caught, a function-level import too."""
    assert layer_of("asyncrl.types") < layer_of("asyncrl.engine.runner") < layer_of("asyncrl.control.run")
    assert layer_of("asyncrl.cli") == layer_of("asyncrl") == len(LAYERS) - 1
    assert all(layer_of(name) >= 0 for name in modules())


def test_the_package_top_level_is_small_and_its_inits_are_docstrings() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top
    # A folder of modules without an __init__ is a namespace package, which the wheel leaves out
    # (setuptools' find_packages): ``asyncrl serve`` once imported only from a checkout.
    folders = {p.parent for p in PACKAGE.rglob("*.py")}
    assert sorted(str(f.relative_to(PACKAGE)) for f in folders if not (f / "__init__.py").is_file()) == []
    for init in PACKAGE.rglob("__init__.py"):
        if init.parent.name == "config":
            continue  # the typed config's public face: ``from asyncrl.config import Config``
        body = ast.parse(init.read_text(encoding="utf-8")).body
        assert all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body), init


def test_no_module_is_over_500_lines_and_the_controller_is_short() -> None:
    long = {
        name: n
        for name, path in modules().items()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > 500
    }
    assert long == {}, f"modules over 500 lines (split them by what they do): {long}"
    assert len((PACKAGE / "control" / "controller.py").read_text(encoding="utf-8").splitlines()) <= 400


def rollout_interface() -> set[str]:
    """Rollout's public methods and properties, and the attributes it declares."""
    members = {n for n, _ in inspect.getmembers(Rollout)} | set(Rollout.__annotations__)
    return {n for n in members if not n.startswith("_")}


@pytest.mark.parametrize(
    ("module", "holder"),
    [
        ("workers/generator.py", "self.rollout"),
        ("workers/evaluation.py", "self.rollout"),
        ("workers/model_evaluation.py", "rollout"),
        ("rollout/evaluation.py", "rollout"),
        ("builtin/warm_start.py", "rollout"),
    ],
)
def test_callers_use_only_the_rollout_interface(module: str, holder: str) -> None:
    """What a caller reads or calls on its rollout is a member of :class:`Rollout`."""
    tree = ast.parse((PACKAGE / module).read_text(encoding="utf-8"))
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) == holder
    }
    assert used, f"{module} never uses {holder}"
    assert used <= rollout_interface(), f"{module} uses {sorted(used - rollout_interface())} beyond Rollout"


@pytest.mark.parametrize("cls", [CompletionRollout, EpisodeRollout])
def test_every_rollout_implements_the_whole_interface(cls: type) -> None:
    assert issubclass(cls, Rollout) and not inspect.isabstract(cls)
    assert not Rollout.__abstractmethods__ - set(vars(cls)), "every abstract method is the class's own"


def test_the_tests_are_laid_out_as_the_package_is() -> None:
    """tests/<package>/ holds the tests of asyncrl/<package>/ (tests/bench/ the benchmarks' short
    forms); only the tests of the package as a whole, and the shared helpers, sit at the top."""
    tests = PACKAGE.parent / "tests"
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    assert folders <= packages | {"bench"}, sorted(folders - packages)
    assert all((tests / folder / "__init__.py").is_file() for folder in folders)
    top = sorted(p.stem for p in tests.glob("test_*.py"))
    assert top == ["test_cli", "test_gpu", "test_layout", "test_markers", "test_user_code"]
    assert all(p.name.startswith("test_bench_") for p in (tests / "bench").glob("test_*.py"))


def test_modules_are_named_by_what_they_hold() -> None:
    """No ``base.py`` or ``build.py``: a seam's contract is its ``interface.py``, and what builds a
    run's parts from the config is named by what it builds (docs/design.md, Names)."""
    vague = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.stem in ("base", "build"))
    assert vague == []
