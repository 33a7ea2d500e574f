"""The suite's own layout, checked: a test module imports helpers from ``tests/support`` only.

No module of the suite imports a test module (``test_*.py``) or ``conftest.py``: what two test
modules share is a helper, and lives in ``tests/support`` under a name that says what it is; a
conftest holds fixtures, which pytest hands out itself. Every import counts: inside functions,
under ``TYPE_CHECKING``, relative ones, and a module named in a string (the code of a
``python -c`` subprocess, ``importlib.import_module``). A violation planted in a copy of the
suite fails the check.
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
#: an import in code held in a string (``python -c``), the module it names
IMPORT_IN_A_STRING = re.compile(r"\b(?:from|import)\s+(tests(?:\.\w+)+)")
#: the functions that import the module a string names
IMPORTERS = ("import_module", "__import__")


def module_name(path: Path, root: Path) -> str:
    """``tests.integration.test_x`` for ``<root>/integration/test_x.py`` (root: the tests
    directory)."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def owning_test_module(name: str) -> str | None:
    """The test module (or conftest) ``name`` is, or is a name in; None for any other."""
    parts = name.split(".")
    if parts[0] != "tests":
        return None
    for end, part in enumerate(parts, 1):
        if part.startswith("test_") or part == "conftest":
            return ".".join(parts[:end])
    return None


def imported(path: Path, root: Path) -> set[str]:
    """Every module name ``path`` imports, or names in a string, as far as it can be told:
    ``from a import b`` gives ``a`` and ``a.b``."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.update(IMPORT_IN_A_STRING.findall(node.value))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if called in IMPORTERS and isinstance(first, ast.Constant):
                found.add(str(first.value))
    return found


def imports_of_test_modules(root: Path = TESTS) -> list[tuple[str, str]]:
    """``(importer, test module)`` for every import of a test module or conftest in the suite
    (a test module that a subprocess imports from itself too)."""
    bad = set()
    for path in sorted(root.rglob("*.py")):
        importer = module_name(path, root)
        for target in imported(path, root):
            module = owning_test_module(target)
            if module is not None:
                bad.add((importer, module))
    return sorted(bad)


def test_no_test_module_imports_another() -> None:
    bad = imports_of_test_modules()
    assert not bad, "move what they share to tests/support: " + ", ".join(
        f"{importer} imports {target}" for importer, target in bad
    )


def test_a_planted_import_of_a_test_module_fails_the_check(tmp_path: Path) -> None:
    copy = tmp_path / "tests"
    shutil.copytree(TESTS, copy, ignore=shutil.ignore_patterns("__pycache__", "data"))
    assert imports_of_test_modules(copy) == []

    def append(relative: str, text: str) -> None:
        target = copy / relative
        target.write_text(target.read_text(encoding="utf-8") + text, encoding="utf-8")

    # the names are put together here, so that this module imports no test module itself
    top = "tests"
    suite = f"{top}.integration"
    code = f"import sys; from {suite}.test_lock import x"
    append("integration/test_cli.py", f"\nfrom {suite}.test_permits import BURST\n")
    append("integration/test_otel.py", "\ndef _late():\n    from .test_publish import client\n")
    append("integration/test_redlock.py", f"\nCODE = {code!r}\n")
    append("integration/test_beat.py", f"\nfrom {suite} import test_beat_mixin\n")
    append("integration/test_chaos.py", f'\nimportlib.import_module("{suite}.test_fencing")\n')
    append("integration/test_pools.py", f"\nfrom {top}.conftest import redis_url\n")
    append("support/bed.py", f"\nimport {top}.unit.test_layers\n")
    append("integration/test_lock.py", "\nfrom . import conftest_free_helpers\n")  # not one

    assert imports_of_test_modules(copy) == [
        ("tests.integration.test_beat", "tests.integration.test_beat_mixin"),
        ("tests.integration.test_chaos", "tests.integration.test_fencing"),
        ("tests.integration.test_cli", "tests.integration.test_permits"),
        ("tests.integration.test_otel", "tests.integration.test_publish"),
        ("tests.integration.test_pools", "tests.conftest"),
        ("tests.integration.test_redlock", "tests.integration.test_lock"),
        ("tests.support.bed", "tests.unit.test_layers"),
    ]


def test_the_check_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The reader finds what the check relies on (a reader that found nothing would let it
    pass): absolute, relative, in a function, under TYPE_CHECKING, in a string."""
    module = tmp_path / "tests" / "integration" / "test_x.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "import tests.support.a\n"
        "from tests.support import b\n"
        "from ..support.c import d\n"
        "if TYPE_CHECKING:\n    from tests.support import e\n"
        "def f():\n    from .helpers import g\n"
        'CODE = "import sys; from tests.support.h import i"\n'
        'importlib.import_module("tests.support.j")\n',
        encoding="utf-8",
    )
    assert imported(module, tmp_path / "tests") >= {
        "tests.support.a",
        "tests.support.b",
        "tests.support.c.d",
        "tests.support.e",
        "tests.integration.helpers.g",
        "tests.support.h",
        "tests.support.j",
    }
    assert "tests.support.bed" in imported(TESTS / "integration" / "test_release_paths.py", TESTS)
    redlock = "tests.integration.test_redlock"
    assert owning_test_module(f"{redlock}.race_launcher") == redlock
    assert owning_test_module("tests.conftest") == "tests.conftest"
    assert owning_test_module("tests.support.bed") is None
    assert owning_test_module("celery_singleton_lock.testing") is None
