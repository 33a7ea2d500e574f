"""The architecture, checked: the core never imports Celery, no import cycles, beat stays apart.

- ``celery_singleton_lock/core/`` imports redis, the standard library, other core modules and
  ``celery_singleton_lock.errors`` only: read from the source (every import, also inside
  functions) and proven at run time with celery, kombu and billiard made unimportable;
- the package's module-level imports form no cycle;
- a worker (``import celery_singleton_lock``) does not load ``celery.beat``;
- the parts SingletonTask is built from (publish.py, policies.py, handle.py) never import
  task.py.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = "celery_singleton_lock"
ROOT = Path(__file__).resolve().parents[2] / PKG
CELERY_FAMILY = ("celery", "kombu", "billiard")
CORE_MAY_IMPORT = (f"{PKG}.core", f"{PKG}.errors")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imports(path: Path, *, module_level_only: bool) -> set[str]:
    """Absolute names of the modules ``path`` imports (``from x import y`` gives ``x.y`` when
    that is a module of the package, else ``x``). Imports under ``if TYPE_CHECKING:`` are left
    out; so are imports inside functions when ``module_level_only``."""
    known = modules()
    name = module_name(path)
    package = name if _is_package(path) else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
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


def test_no_import_cycles() -> None:
    known = modules()
    graph = {
        name: {t for t in imports(path, module_level_only=True) if t in known and t != name}
        for name, path in known.items()
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                walk(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node)


def test_a_worker_does_not_load_celery_beat() -> None:
    code = (
        "import sys, celery_singleton_lock, celery_singleton_lock.worker;"
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
import celery_singleton_lock, celery_singleton_lock.worker, celery_singleton_lock.beat.witness
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


@pytest.mark.parametrize("module", ["publish.py", "policies.py", "handle.py", "_tasklog.py"])
def test_the_tasks_parts_never_import_the_task(module: str) -> None:
    """SingletonTask is built from these (its bases, its handle, its logger): they never import
    task.py, not even inside a function."""
    found = imports(ROOT / module, module_level_only=False)
    assert f"{PKG}.task" not in found, sorted(found)


def test_the_checks_see_imports() -> None:
    """The import reader finds what the checks rely on (a reader that found nothing would let
    every check pass)."""
    assert f"{PKG}.core.store" in imports(ROOT / "core" / "cluster.py", module_level_only=True)
    assert "celery" in imports(ROOT / "task.py", module_level_only=True)
    assert f"{PKG}.beat.scheduler" in imports(
        ROOT / "beat" / "__init__.py", module_level_only=False
    )
    assert f"{PKG}.beat.scheduler" not in imports(
        ROOT / "beat" / "__init__.py", module_level_only=True
    )
