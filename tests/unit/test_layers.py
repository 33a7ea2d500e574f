"""The architecture, checked (docs/internals.md, "Module map").

The package is a stack of wings. A module may import its own wing and the wings below it, never
one above, and every import counts: inside functions and under ``TYPE_CHECKING`` too.

- leaves: ``errors.py``, ``signals.py``;
- ``core/``: the lock; redis and the standard library, never celery, kombu or billiard;
- ``settings/``: the settings table and reading it;
- ``beat/``: the scheduler, its claims and the workers' witness;
- ``run/``: what every run holds and leaves: log, call reprs, handle, events, completion;
- ``publish/``: publish-time dedup;
- ``duplicates/``: what a duplicate meets: policies, coalesce, skips, the canvas;
- ``task/``: SingletonTask, and the tracer hook that runs it;
- ``worker/``: the worker's main process: hooks, main-process skip, reaper, start-up checks;
- ``tools/``: the CLI, metrics, the pytest plugin;
- the face: ``__init__.py`` and the documented import paths (redlock, metrics, testing).

``_dev/`` stands apart: it imports nothing of the package and nothing of the package imports
it. Besides: no import cycle anywhere, no module over 500 lines, every module placed in a wing,
the core loads with Celery unimportable, a worker does not load ``celery.beat``, and only the
database scheduler loads Django. A violation planted in a copy of the package fails each check.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

PKG = "celery_singleton_lock"
ROOT = Path(__file__).resolve().parents[2] / PKG
CELERY_FAMILY = ("celery", "kombu", "billiard")
CORE_MAY_IMPORT = (f"{PKG}.core", f"{PKG}.errors")

#: The wings, lowest first.
LAYERS = (
    "leaves",
    "core",
    "settings",
    "beat",
    "run",
    "publish",
    "duplicates",
    "task",
    "worker",
    "tools",
    "face",
)
RANK = {wing: rank for rank, wing in enumerate(LAYERS)}
LEAVES = frozenset({"errors", "signals"})
#: Top-level modules that only give a documented import path to a name that lives in a wing.
SHIMS = frozenset({"redlock", "metrics", "testing"})
APART = "_dev"
MAX_LINES = 500


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def wing_of(name: str) -> str | None:
    """The wing of a module of the package (None: a module no wing holds)."""
    parts = name.split(".")
    if len(parts) == 1:
        return "face"
    top = parts[1]
    if top in LEAVES:
        return "leaves"
    if top in SHIMS:
        return "face"
    if top == APART or (top in RANK and top not in ("leaves", "face")):
        return top
    return None


def imports(
    path: Path,
    *,
    module_level_only: bool,
    typing: bool = False,
    root: Path = ROOT,
    known: dict[str, Path] | None = None,
) -> set[str]:
    """Absolute names of the modules ``path`` imports (``from x import y`` gives ``x.y`` when
    that is a module of the package, else ``x``). Imports under ``if TYPE_CHECKING:`` count
    only when ``typing``; imports inside functions only when not ``module_level_only``.
    ``known``: the package's modules, when the caller has them already."""
    known = modules(root) if known is None else known
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                if typing:
                    visit(node.body)
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.add(sub if sub in known else target)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and module_level_only:
                continue
            for field in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    visit([c for c in children if isinstance(c, ast.stmt | ast.ExceptHandler)])  # type: ignore[misc]
            if isinstance(node, ast.ExceptHandler):
                visit(node.body)

    visit(tree.body)
    return found


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Every module's imports of the package's modules: all of them (in functions, typing)."""
    known = modules(root)
    return {
        name: {
            t
            for t in imports(path, module_level_only=False, typing=True, root=root, known=known)
            if t in known and t != name
        }
        for name, path in known.items()
    }


def unplaced(root: Path = ROOT) -> list[str]:
    return sorted(name for name in modules(root) if wing_of(name) is None)


def layer_violations(root: Path = ROOT) -> list[tuple[str, str]]:
    """``(module, imported)`` for each import of a wing above the importer's, or across
    ``_dev``'s fence."""
    bad = []
    for name, targets in graph(root).items():
        mine = wing_of(name)
        for target in sorted(targets):
            theirs = wing_of(target)
            if mine is None or theirs is None:
                continue  # unplaced() reports them
            if APART in (mine, theirs):
                if mine != theirs:
                    bad.append((name, target))
            elif RANK[theirs] > RANK[mine]:
                bad.append((name, target))
    return bad


def find_cycle(root: Path = ROOT) -> list[str] | None:
    edges = graph(root)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := walk(node)):
            return found
    return None


def oversized(root: Path = ROOT) -> list[tuple[str, int]]:
    sizes = {
        name: len(path.read_text(encoding="utf-8").splitlines())
        for name, path in modules(root).items()
    }
    return sorted((name, n) for name, n in sizes.items() if n > MAX_LINES)


def test_every_module_sits_in_a_wing() -> None:
    assert not unplaced(), "place these in a wing (LAYERS) or make them a documented shim"
    wings = {wing_of(name) for name in modules()}
    assert wings == {*LAYERS, APART}, sorted(map(str, wings))


def test_no_wing_imports_a_wing_above_it() -> None:
    assert not layer_violations()


def test_no_import_cycle_anywhere() -> None:
    """Every import counts: a cycle only under TYPE_CHECKING or inside a function is still two
    modules that cannot be read apart."""
    cycle = find_cycle()
    assert cycle is None, " -> ".join(cycle or [])


def test_no_module_over_500_lines() -> None:
    assert not oversized()


def test_a_planted_violation_fails_each_check(tmp_path: Path) -> None:
    copy = tmp_path / PKG
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert (unplaced(copy), layer_violations(copy), find_cycle(copy), oversized(copy)) == (
        [],
        [],
        None,
        [],
    )

    def append(relative: str, text: str) -> None:
        target = copy / relative
        target.write_text(target.read_text(encoding="utf-8") + text, encoding="utf-8")

    append("core/fencing.py", "\ndef _late():\n    from ..task import SingletonTask\n")
    append("run/log.py", "\nfrom .._dev import process\n")
    append("run/events.py", "\nimport typing\nif typing.TYPE_CHECKING:\n    from . import handle\n")
    append("run/handle.py", "\nfrom . import events\n")
    append("run/callrepr.py", "\n" * (MAX_LINES + 1))
    (copy / "stray.py").write_text("", encoding="utf-8")

    assert layer_violations(copy) == [
        (f"{PKG}.core.fencing", f"{PKG}.task"),
        (f"{PKG}.run.log", f"{PKG}._dev.process"),
    ]
    assert set(find_cycle(copy) or []) == {f"{PKG}.run.events", f"{PKG}.run.handle"}
    assert [name for name, _ in oversized(copy)] == [f"{PKG}.run.callrepr"]
    assert unplaced(copy) == [f"{PKG}.stray"]


def test_the_core_imports_neither_celery_nor_the_glue() -> None:
    core = {name: path for name, path in modules().items() if name.startswith(f"{PKG}.core")}
    assert len(core) >= 10, sorted(core)
    bad = {}
    for name, path in core.items():
        for target in imports(path, module_level_only=False):
            top = target.partition(".")[0]
            if top in CELERY_FAMILY or (top == PKG and not target.startswith(CORE_MAY_IMPORT)):
                bad.setdefault(name, []).append(target)
    assert not bad, f"core modules import outside the core: {bad}"


def test_the_core_loads_with_celery_unimportable() -> None:
    """Every core module imported in a process where celery, kombu and billiard cannot be."""
    names = sorted(n for n in modules() if n.startswith(f"{PKG}.core"))
    code = f"""
import importlib, importlib.abc, sys, types
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {CELERY_FAMILY!r}:
            raise ImportError("blocked: " + name)
        return None
sys.meta_path.insert(0, Block())
# the package's own __init__ wires the Celery glue: stand in for it, keep its path
package = types.ModuleType({PKG!r})
package.__path__ = [{str(ROOT)!r}]
sys.modules[{PKG!r}] = package
for name in {names!r}:
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in {CELERY_FAMILY!r})
assert not loaded, loaded
print("ok", len({names!r}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok"), done.stdout


def test_a_worker_does_not_load_celery_beat() -> None:
    code = (
        "import sys, celery_singleton_lock, celery_singleton_lock.worker.hooks;"
        "assert 'celery.beat' not in sys.modules, 'celery.beat loaded';"
        "from celery_singleton_lock import SingletonScheduler;"
        "assert 'celery.beat' in sys.modules;"
        "from celery_singleton_lock.beat import SingletonScheduler as same;"
        "assert same is SingletonScheduler; print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_only_the_database_scheduler_loads_django() -> None:
    """With django and django_celery_beat unimportable, the package, the worker hooks, the
    beat package and SingletonScheduler all load; only SingletonDatabaseScheduler needs them.
    Read from the source too: no other module imports them, even inside a function."""
    django_family = ("django", "django_celery_beat")
    for name, path in modules().items():
        if name == f"{PKG}.beat.django_beat":
            continue
        found = {t.partition(".")[0] for t in imports(path, module_level_only=False)}
        assert not found & set(django_family), f"{name} imports {sorted(found)}"
    code = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {django_family!r}:
            raise ImportError("blocked: " + name)
        return None
sys.meta_path.insert(0, Block())
import celery_singleton_lock, celery_singleton_lock.worker.hooks, celery_singleton_lock.beat.witness
from celery_singleton_lock import SingletonScheduler, SingletonSchedulerMixin
from celery_singleton_lock.beat import SingletonScheduler
try:
    from celery_singleton_lock.beat import SingletonDatabaseScheduler
except ImportError as exc:
    assert "pip install django-celery-beat" in str(exc), exc
else:
    raise AssertionError("SingletonDatabaseScheduler loaded without django_celery_beat")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_the_checks_see_imports() -> None:
    """The import reader finds what the checks rely on (a reader that found nothing would let
    every check pass)."""
    assert f"{PKG}.core.store" in imports(ROOT / "core" / "cluster.py", module_level_only=True)
    assert "celery" in imports(ROOT / "task" / "singleton_task.py", module_level_only=True)
    assert f"{PKG}.beat.scheduler" in imports(
        ROOT / "beat" / "__init__.py", module_level_only=False
    )
    assert f"{PKG}.beat.scheduler" not in imports(
        ROOT / "beat" / "__init__.py", module_level_only=True
    )
    typed = imports(ROOT / "worker" / "scopes.py", module_level_only=True, typing=True)
    assert f"{PKG}.task.singleton_task" in typed
    plain = imports(ROOT / "worker" / "scopes.py", module_level_only=True)
    assert f"{PKG}.task.singleton_task" not in plain
    assert len(graph()) == len(modules()) > 60
