"""The duplicate policies are parts (duplicates/policy.py): each lives in its own module, and no
other module asks which policy a task has.

- No module compares a policy's name (``on_duplicate == "join"``, ``policy in ("skip", ...)``,
  a ``match`` case) but that policy's own module and the settings table; a comparison planted in
  a copy of the package is found.
- The settings table's choices and the policy modules agree, one policy per module.
- A new policy is its module and its name in the settings table: a copy of the package with
  just those two edits runs a task under it, on real Redis.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import celery_singleton_lock
from celery_singleton_lock.duplicates import policy as policy_module
from celery_singleton_lock.duplicates.policy import Part, Policy, policies
from celery_singleton_lock.settings.table import POLICIES

PKG = "celery_singleton_lock"
ROOT = Path(celery_singleton_lock.__file__).resolve().parent
TABLE = Path("settings") / "table.py"


def _named_constants(node: ast.AST, names: frozenset[str]) -> set[str]:
    """The policy names ``node`` is, or holds (a tuple, list or set of them)."""
    if isinstance(node, ast.Constant) and node.value in names:
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names}
    return set()


def name_comparisons(path: Path, names: frozenset[str]) -> list[tuple[int, str]]:
    """``(line, name)`` of each comparison of ``path`` against a policy's name."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                found += [(node.lineno, name) for name in _named_constants(operand, names)]
        elif isinstance(node, ast.MatchValue):
            found += [(node.lineno, name) for name in _named_constants(node.value, names)]
    return found


def policy_files(root: Path) -> dict[str, Path]:
    """Each policy's name and the module that defines it, read from the source of ``root``."""
    owners: dict[str, Path] = {}
    for path in sorted((root / "duplicates").glob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if (
                    isinstance(item, ast.Assign)
                    and [getattr(t, "id", None) for t in item.targets] == ["name"]
                    and isinstance(item.value, ast.Constant)
                    and item.value.value
                ):
                    owners[str(item.value.value)] = path
    return owners


def misplaced_comparisons(root: Path, names: frozenset[str]) -> list[str]:
    """Every comparison with a policy's name outside that policy's module and the table."""
    owners = policy_files(root)
    bad = []
    for path in sorted(root.rglob("*.py")):
        if path == root / TABLE:
            continue
        for line, name in name_comparisons(path, names):
            if owners.get(name) != path:
                bad.append(f"{path.relative_to(root)}:{line} compares {name!r}")
    return bad


def test_no_module_compares_a_policys_name_but_its_own() -> None:
    assert misplaced_comparisons(ROOT, frozenset(POLICIES)) == []


def test_a_planted_comparison_is_found(tmp_path: Path) -> None:
    copy = tmp_path / PKG
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    names = frozenset(POLICIES)
    assert misplaced_comparisons(copy, names) == []

    def append(relative: str, text: str) -> None:
        target = copy / relative
        target.write_text(target.read_text(encoding="utf-8") + text, encoding="utf-8")

    append("task/endings.py", "\ndef _a(opts):\n    return opts.on_duplicate == 'join'\n")
    append("worker/mainskip.py", "\ndef _b(p):\n    return p in ('skip', 'coalesce')\n")
    append(
        "duplicates/retry.py",
        "\ndef _c(p):\n    match p:\n        case 'raise':\n            return 1\n    return 0\n",
    )
    append("duplicates/join.py", "\ndef _d(p):\n    return 'join' != p\n")  # its own: allowed
    found = [
        entry.split(":")[0] + ":" + entry.rpartition(" ")[2]
        for entry in misplaced_comparisons(copy, names)
    ]
    assert sorted(found) == [
        "duplicates/retry.py:'raise'",
        "task/endings.py:'join'",
        "worker/mainskip.py:'coalesce'",
        "worker/mainskip.py:'skip'",
    ]


def test_the_table_and_the_policy_modules_agree() -> None:
    found = policies()
    assert sorted(found) == sorted(POLICIES)
    modules = [type(policy).__module__ for policy in found.values()]
    assert len(set(modules)) == len(modules), modules  # one policy per module
    for name, policy in found.items():
        assert isinstance(policy, Policy)
        assert policy.name == name
        assert policy.setting == "singleton_on_duplicate"
    assert {path.stem for path in policy_files(ROOT).values()} == {
        m.rpartition(".")[2] for m in modules
    }


def test_every_modifier_names_its_setting_and_every_hook_is_documented() -> None:
    policies()  # every module of duplicates/ imported: the modifiers registered
    modifiers = policy_module._MODIFIERS
    settings = sorted(part.setting for part in modifiers)
    assert settings == [
        "singleton_debounce",
        "singleton_lock_at_least",
        "singleton_lock_on",
        "singleton_permits",
        "singleton_rate_limit",
    ]
    for cls in (Part, Policy):
        for name, member in vars(cls).items():
            if callable(member) and not name.startswith("_"):
                assert member.__doc__, f"{cls.__name__}.{name} has no docstring"
                assert f"``{name}``" in policy_module.__doc__ or name in {
                    "applies",
                    "refuse",
                }, f"the lifecycle table does not say when {name} is called"


NEW_POLICY = '''
"""``singleton_on_duplicate="oldest"``: a test's policy, planted in a copy of the package."""

from .policy import Action, Fate, Policy, Why


class OldestPolicy(Policy):
    name = "oldest"

    def on_contended(self, call, held, opts):
        return Action(Fate.SKIP, Why.DUPLICATE, holder="oldest:" + held.holder, policy=self.name)
'''


def test_a_new_policy_is_its_module_and_its_name_in_the_table(
    tmp_path: Path, redis_url: str, key_prefix: str
) -> None:
    copy = tmp_path / PKG
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "duplicates" / "oldest.py").write_text(NEW_POLICY, encoding="utf-8")
    table = copy / TABLE
    text = table.read_text(encoding="utf-8")
    old = "POLICIES = (" + ", ".join(f'"{name}"' for name in POLICIES) + ")"
    assert old in text
    table.write_text(text.replace(old, old[:-1] + ', "oldest")'), encoding="utf-8")
    assert misplaced_comparisons(copy, frozenset((*POLICIES, "oldest"))) == []
    code = f"""
import sys
sys.path.insert(0, {str(tmp_path)!r})
import celery_singleton_lock
assert celery_singleton_lock.__file__.startswith({str(tmp_path)!r}), celery_singleton_lock.__file__
from celery import Celery
from celery_singleton_lock import SingletonTask, skip_info
from celery_singleton_lock.core.connection import store_for

app = Celery("t", broker="memory://", backend="cache+memory://")
app.conf.update(singleton_redis_url={redis_url!r}, singleton_key_prefix={key_prefix!r},
                task_always_eager=True, task_store_eager_result=True)

@app.task(base=SingletonTask, singleton_on_duplicate="oldest")
def work(key):
    return "ran"

keys = work.singleton_keys(("k",), {{}})
store_for(work.singleton_options().redis_url).acquire(keys, "other-run", 0, 10_000)
info = skip_info(work.delay("k"))
store_for(work.singleton_options().redis_url).release(keys.lock, "other-run", 0)
assert info is not None and info.holder == "oldest:other-run", info
assert work.delay("k").get() == "ran"
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_the_task_class_documents_every_task_option_of_the_settings_table() -> None:
    """SingletonTask's attributes come from the settings table: each task option is an
    attribute (None: not set), documented with ``#:`` in the class, as in Celery's task.py."""
    import inspect

    from celery_singleton_lock import SingletonTask
    from celery_singleton_lock.settings.table import SETTINGS

    source = inspect.getsource(SingletonTask)
    options = [s.conf_key for s in SETTINGS.values() if s.task_option]
    assert len(options) >= 16, options
    for name in options:
        assert name in vars(SingletonTask), f"SingletonTask has no attribute {name}"
        assert vars(SingletonTask)[name] is None, name
        lines = source.splitlines()
        at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{name}:"))
        assert lines[at - 1].strip().startswith("#:"), f"{name} is not documented with #:"
    given = {n for n in vars(SingletonTask) if n.startswith("singleton_") and n.count("_") >= 1}
    stray = {n for n in given if not callable(getattr(SingletonTask, n, None))} - set(options)
    assert not stray, f"attributes the settings table does not have: {sorted(stray)}"
