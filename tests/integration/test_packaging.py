"""The package as users install it: a bare install, and the oldest and newest dependencies.

- `pip install celery-singleton-lock` alone runs the README's example: the wheel of this checkout
  is built, installed with no extras (its dependencies from the package registry) into a venv of
  its own, and the README's "Ten lines" example, taken from README.md, runs there against a
  private Redis: a real ``celery worker`` and the caller both use the fresh venv's python, and
  see neither this checkout nor the test run's virtualenv.
- The lower bounds in pyproject.toml work, and every Python version the classifiers name: a
  fresh venv with every direct dependency pinned to its lower bound (``celery[redis]==5.3.5``
  ...; the rest resolved by pip), or with the newest of everything, runs :data:`SMOKE`, a
  subset of this suite, on real workers and beats, after compiling every module of the
  installed package with that venv's Python (its syntax, whatever the smoke subset imports).
  The classifiers claim only what is tested.

Which dependencies on which Python (:func:`smoke_cells`): the suite's own Python (3.11, where
the whole suite runs) gets the newest, and the lower bounds too only when the oldest classified
Python is not found (so they are tested on a machine with no other Python); the oldest
classified (3.10) gets the lower bounds, the pair most likely to break
(the oldest Celery on the oldest Python the package claims); every other (3.12, 3.13) gets the
newest, what a new install there resolves to. Every pair would be twice the venvs for little
more: one costs about 45 s of an xdist worker alone (a venv 4 s, pip install 8-12 s, the smoke
subset 29-34 s, measured on the 2-core CI machine) and 55 CPU-seconds, 70-85 s while the
others run beside it. An interpreter is found as a contributor's machine has it
(tests/support/pythons.py: ``python3.X`` on PATH, else pyenv's newest 3.X.Z); a classified
version with none is skipped with a line naming it, never failed nor passed over silently.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from importlib import metadata
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the test extra installs tomli
    import tomli as tomllib

import pytest
import redis
from packaging.requirements import Requirement

from tests.support.pythons import find_python, looked_in
from tests.support.servers import RedisServer
from tests.support.waiting import wait_for
from tests.support.workers import REPO_ROOT, WorkerFactory

#: where the stand-in for the example's ``write_balance`` records its calls (a list)
CALLS_KEY = "readme:write_balance"


def readme_example() -> str:
    """The first python block under README.md's "## Ten lines"."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("\n## Ten lines\n", 1)
    assert len(section) == 2, "README.md has no '## Ten lines' section"
    found = re.search(r"^```python\n(.*?)^```$", section[1].split("\n## ", 1)[0], re.M | re.S)
    assert found is not None, "no ```python block under README.md's '## Ten lines'"
    return found.group(1)


def run(args: list[str], what: str, timeout: float, cwd: Path | None = None) -> str:
    """Run ``args`` to completion (without PYTHONPATH); fail with its output unless it exits 0.
    Return the output (stdout and stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run(
        args,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, f"{what} exited with {proc.returncode}:\n{proc.stdout}"
    return proc.stdout


PIP = ("-m", "pip", "--disable-pip-version-check")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout, built once per test run: by the first xdist worker that
    needs it, in the run's base temp directory, while the others wait on a file lock (each
    build costs ~10 s, and the tests that use it run on different workers)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's directory, shared by its workers (popen-gw0, ...)
    wheels = base / "wheel-of-this-checkout"
    with open(base / "wheel.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not wheels.is_dir():
                building = Path(tempfile.mkdtemp(prefix="wheel-building-", dir=base))
                build = ["wheel", "--no-deps", "-w", str(building), str(REPO_ROOT)]
                run([sys.executable, *PIP, *build], "building the wheel", timeout=300)
                building.rename(wheels)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    (built,) = wheels.glob("celery_singleton_lock-*.whl")
    return built


def new_venv(python: str, where: Path, *requirements: str) -> Path:
    """A new venv at ``where`` made by ``python``, with ``requirements`` pip-installed (without
    compiling every installed module to bytecode up front: Python compiles what it imports)."""
    run([python, "-m", "venv", str(where)], f"{python} -m venv", timeout=120)
    run(
        [str(where / "bin" / "python"), *PIP, "install", "--no-compile", *requirements],
        f"pip install {' '.join(requirements)}",
        timeout=300,
    )
    return where


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    """A new venv holding the wheel of this checkout, installed with no extras."""
    return new_venv(sys.executable, tmp_path_factory.mktemp("venv"), str(wheel))


@pytest.mark.slow(seconds=11)
def test_readme_example_runs_from_a_bare_install(
    fresh_venv: Path, private_redis: RedisServer, tmp_path: Path
) -> None:
    """The README's ten lines, in a venv with only the package: the run took and freed its lock.

    Only the example's Redis URLs are replaced (by the private server's), and the
    ``write_balance`` it leaves to the reader is defined after it, recording its calls in
    Redis. The worker (pool solo) and the caller of ``sync_account.delay(42)`` run on the
    fresh venv's python.
    """
    example = readme_example()
    example, urls = re.subn(r"redis://[^\"'\s]+", private_redis.url, example)
    assert urls >= 1, f"the README's example names no redis:// URL:\n{example}"
    app_dir = tmp_path / "app"
    app_dir.mkdir()
    recorder = f"""
        import redis as _recorder


        def write_balance(account_id, token):
            client = _recorder.Redis.from_url({private_redis.url!r})
            client.rpush({CALLS_KEY!r}, f"{{account_id}} {{token}}")
            client.close()
        """
    (app_dir / "billing.py").write_text(example + textwrap.dedent(recorder))
    (app_dir / "driver.py").write_text(
        textwrap.dedent(
            """
            import json

            import celery_singleton_lock
            from billing import sync_account

            result = sync_account.delay(42)
            result.get(timeout=60)
            print(json.dumps({"state": result.state, "module": celery_singleton_lock.__file__}))
            """
        )
    )
    python = str(fresh_venv / "bin" / "python")
    # the app and nothing of this checkout or the test run's virtualenv on sys.path
    env = {
        "PYTHONPATH": str(app_dir),
        "PATH": f"{fresh_venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    workers = WorkerFactory(tmp_path)
    client = redis.Redis.from_url(private_redis.url, decode_responses=True)
    try:
        worker = workers.start(
            "billing", pool="solo", concurrency=1, env=env, python=python, cwd=app_dir
        )
        driver = subprocess.run(
            [python, str(app_dir / "driver.py")],
            cwd=app_dir,
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert driver.returncode == 0, (
            f"sync_account.delay(42) from the fresh venv exited with {driver.returncode}:\n"
            f"{driver.stdout}{driver.stderr}\nworker log:\n{worker.log_tail()}"
        )
        done = json.loads(driver.stdout.strip().splitlines()[-1])
        assert done["state"] == "SUCCESS", driver.stdout
        assert Path(done["module"]).is_relative_to(fresh_venv), done

        calls = client.lrange(CALLS_KEY, 0, -1)
        assert len(calls) == 1, (calls, worker.log_tail())
        account, token = calls[0].split()
        assert account == "42"

        def released() -> list[str] | None:
            keys = [str(key) for key in client.keys("singleton:*")]
            return None if any(key.endswith(":lock") for key in keys) else keys

        # the lock is freed once the run ended; its fencing counter holds the run's token
        keys = wait_for(released, 30, "the lock to be released", worker)
        (fence,) = keys
        assert fence.startswith("singleton:{billing.sync_account:"), keys
        assert fence.endswith(":fence"), keys
        assert client.get(fence) == token
    finally:
        client.close()
        workers.close()


# -- the oldest and the newest dependencies, on every classified Python -------------------------

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())

#: The suite's smoke subset for other dependency versions, one or two tests per part: the three
#: duplicate policies and their signals, a lock taken away from its run, and a hand-over to
#: self.retry() on real workers; eager mode; the command on a live worker; the metrics and the
#: dashboard; the task logger; a pool child's lock released by the main process; beats claiming
#: and publishing runs (a real beat's banner; two schedulers in this process claiming one
#: run); the fast cells of the matrix of Celery's own features.
SMOKE = (
    "tests/integration/test_policies.py::test_signals_for_skip_raise_and_retry",
    "tests/integration/test_policies.py::test_lock_taken_by_another_owner_is_reported_lost",
    "tests/integration/test_eager.py",
    "tests/integration/test_cli.py::test_list_purge_and_release_on_a_live_worker",
    "tests/integration/test_metrics.py",
    "tests/integration/test_task_logs.py",
    "tests/integration/test_release_paths.py::test_retry_hands_the_lock_over",
    "tests/integration/test_release_paths.py::test_child_sigkill_released_by_main_process",
    "tests/integration/test_beat.py::test_banner_shows_mode_redis_without_password_and_prefix",
    "tests/integration/test_beat_mixin.py::test_crontab_run_published_once_by_two_instances",
    "tests/integration/test_beat_mixin.py::test_leader_mode_mixin_only_the_leader_publishes",
    # Celery's own features: a refused retry, a before_start without super(), two matrix cells
    "tests/integration/test_celery_features.py::"
    "test_a_retry_that_max_retries_refuses_releases_the_lock_at_once[prefork]",
    "tests/integration/test_celery_features.py::"
    "test_a_before_start_override_without_super_keeps_the_lock_renewed[prefork]",
    "tests/integration/test_celery_features.py::test_each_ending_under_each_policy[prefork-return-retry]",
    "tests/integration/test_celery_features.py::"
    "test_each_ending_under_each_policy[prefork-retry_refused-coalesce]",
)

#: What the test extra holds that :data:`SMOKE` does not use, left out of its venvs (their
#: install was most of the test's time): the linters, the peers of the benchmarks, the green
#: pools, and the tracing, monitoring and test tools the library meets. Without them, the smoke
#: run also shows the library without its optional integrations installed.
SMOKE_LEAVES_OUT = frozenset(
    {
        "ruff",
        "mypy",
        "celery-singleton",
        "celery-once",
        "python-redis-lock",
        "pottery",
        "celery-heimdall",
        "gevent",
        "eventlet",
        "flower",
        "pytest-celery",
        "opentelemetry-api",
        "opentelemetry-sdk",
        "opentelemetry-instrumentation-celery",
        "sentry-sdk",
    }
)


def smoke_requirements() -> list[str]:
    """The test extra, without :data:`SMOKE_LEAVES_OUT`."""
    extra = PYPROJECT["project"]["optional-dependencies"]["test"]
    return [r for r in extra if _normal(Requirement(r).name) not in SMOKE_LEAVES_OUT]


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


#: Warnings of old dependencies that the smoke run lets pass (the suite turns warnings into
#: errors): kombu before 5.7 passes redis-py a command name that redis-py 5.3+ deprecates, and
#: an old Celery's result backend leaves a socket to the garbage collector.
SMOKE_WARNINGS = (
    "ignore:Call to 'get_connection' function with deprecated usage:DeprecationWarning",
    "ignore::pytest.PytestUnraisableExceptionWarning",
)


def lower_bounds() -> list[str]:
    """Every direct dependency pinned to its lower bound (``>=``) in pyproject.toml."""
    pins = []
    for spec in PYPROJECT["project"]["dependencies"]:
        requirement = Requirement(spec)
        (low,) = [s.version for s in requirement.specifier if s.operator == ">="] or [None]
        assert low is not None, f"{spec}: no lower bound (>=) to test"
        extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
        pins.append(f"{requirement.name}{extras}=={low}")
    return pins


def classified_pythons() -> list[str]:
    """The X.Y of every "Programming Language :: Python :: X.Y" classifier."""
    prefix = "Programming Language :: Python :: "
    versions = [
        c.removeprefix(prefix)
        for c in PYPROJECT["project"]["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: \d+\.\d+", c)
    ]
    assert versions, "pyproject.toml classifies no Python version"
    return versions


#: the X.Y of this interpreter, the one the whole suite runs on
HERE = f"{sys.version_info.major}.{sys.version_info.minor}"


def version_key(version: str) -> tuple[int, ...]:
    return tuple(map(int, version.split(".")))


def interpreter(version: str) -> str:
    """This interpreter if it is ``version``, else one found on this machine (PATH, pyenv);
    the test is skipped, with a line naming the version, when there is none."""
    if version == HERE:
        return sys.executable
    found = find_python(version)
    if found is None:
        pytest.skip(f"Python {version} is classified but not found: {looked_in(version)}")
    return str(found)


#: the usual wall time of each smoke run, setup included (@pytest.mark.slow): the lower bounds
#: here cost a venv and the smoke subset, the newest here mostly a ``pip install --dry-run``
#: (test_smoke_on_oldest_and_newest_dependencies), any on another Python a venv and the subset
SMOKE_SECONDS = {("lowest", HERE): 60, ("newest", HERE): 20}
OTHER_PYTHON_SECONDS = 60


def smoke_cells() -> list[Any]:
    """``(deps, python_version)`` of each smoke run: ``lowest`` on the oldest classified
    version, ``newest`` on every other; on this interpreter's version ``newest`` (mostly a
    dry run), and ``lowest`` too when the oldest version is not found here (the lower bounds
    are then tested on this one; the module's docstring says why)."""
    versions = classified_pythons()
    oldest = min(versions, key=version_key)
    oldest_found = oldest == HERE or find_python(oldest) is not None
    cells = []
    for version in versions:
        if version == HERE:
            kinds = ["newest"] if oldest_found else ["lowest", "newest"]
        else:
            kinds = ["lowest"] if version == oldest else ["newest"]
        for deps in kinds:
            seconds = SMOKE_SECONDS.get((deps, version), OTHER_PYTHON_SECONDS)
            cells.append(pytest.param(deps, version, marks=pytest.mark.slow(seconds=seconds)))
    return cells


def test_lower_bounds_are_read_from_pyproject() -> None:
    """The pins name every direct dependency, and the classifiers Pythons that requires-python
    allows, its lower bound among them: the oldest Python it lets install is smoke-tested."""
    pins = lower_bounds()
    names = {Requirement(pin).name for pin in pins}
    assert names == {"celery", "kombu", "redis", "hiredis"}, pins
    assert all("==" in pin for pin in pins)
    low = Requirement(next(p for p in pins if p.startswith("celery"))).specifier
    assert low.contains("5.3.5"), pins
    required = PYPROJECT["project"]["requires-python"].removeprefix(">=")
    for version in classified_pythons():
        assert version_key(version) >= version_key(required), version
    assert min(classified_pythons(), key=version_key) == required, classified_pythons()


DRY_RUN = (sys.executable, *PIP, "install", "--dry-run", "--ignore-installed", "-q", "--report")
#: The packages compared to decide whether the suite's own venv has the newest releases.
RUNTIME = ("celery", "kombu", "redis", "hiredis", "billiard", "vine", "amqp")


def newest_versions(requirements: list[str], report: Path) -> dict[str, str]:
    """The versions of :data:`RUNTIME` that pip would install for ``requirements`` in a new
    venv today (``pip install --dry-run --ignore-installed --report``)."""
    run(
        [*DRY_RUN, str(report), *requirements],
        f"pip install --dry-run {' '.join(requirements)}",
        timeout=300,
    )
    found = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    return {name: found[name] for name in RUNTIME}


def installed(python: Path, *names: str) -> dict[str, str]:
    """Installed version of each of ``names`` in the venv of ``python``."""
    code = (
        "import importlib.metadata as m, json, sys; "
        "print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))"
    )
    out = subprocess.run(
        [str(python), "-c", code, *names], capture_output=True, text=True, check=True, timeout=60
    )
    return dict(json.loads(out.stdout))


#: what prints the venv's site-packages directory
PURELIB = "import sysconfig; print(sysconfig.get_paths()['purelib'])"


def compile_every_module(python: Path, version: str) -> None:
    """Compile every module of the package installed in the venv of ``python`` (pip installed
    it without), with that Python: a syntax it does not know fails, in a module the smoke
    subset imports or not."""
    site = Path(run([str(python), "-c", PURELIB], "sysconfig", timeout=60).strip())
    package = site / "celery_singleton_lock"
    assert (package / "__init__.py").is_file(), f"the package is not installed in {site}"
    run(
        [str(python), "-m", "compileall", "-q", "-f", str(package)],
        f"compiling every module of the package on Python {version}",
        timeout=120,
    )


def test_compiling_fails_on_a_syntax_the_oldest_python_lacks(tmp_path: Path) -> None:
    """The compile step of the smoke runs fails on a module with a syntax newer than the
    oldest classified Python (``except*``, 3.11+), planted in a copy of the package in a venv of
    that Python (one without pip: nothing is installed)."""
    oldest = min(classified_pythons(), key=version_key)
    if version_key(oldest) >= (3, 11):
        pytest.skip(f"the oldest classified Python, {oldest}, has except*: nothing to plant")
    venv = tmp_path / "venv"
    run([interpreter(oldest), "-m", "venv", "--without-pip", str(venv)], "venv", timeout=60)
    python = venv / "bin" / "python"
    site = Path(run([str(python), "-c", PURELIB], "sysconfig", timeout=60).strip())
    shutil.copytree(
        REPO_ROOT / "celery_singleton_lock",
        site / "celery_singleton_lock",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    compile_every_module(python, oldest)  # the package as it is compiles

    planted = site / "celery_singleton_lock" / "planted.py"
    planted.write_text("try:\n    pass\nexcept* ValueError:\n    pass\n")
    expected = f"compiling every module of the package on Python {oldest} exited with 1"
    with pytest.raises(AssertionError, match=re.escape(expected)) as failed:
        compile_every_module(python, oldest)
    assert "planted.py" in str(failed.value), failed.value
    assert "SyntaxError" in str(failed.value), failed.value


@pytest.mark.parametrize(("deps", "python_version"), smoke_cells())
def test_smoke_on_oldest_and_newest_dependencies(
    wheel: Path, tmp_path: Path, deps: str, python_version: str
) -> None:
    """A fresh venv with the direct dependencies at their lower bounds (``lowest``: exactly the
    versions pyproject.toml claims) or at their newest (``newest``, whatever the registry has
    today), on the Python ``python_version`` (:func:`smoke_cells`), with the test extra (without
    :data:`SMOKE_LEAVES_OUT`): every module of the installed package compiles there, and
    :data:`SMOKE` runs there on real workers and beats. The run's versions are printed.

    ``newest`` on this interpreter first asks pip what a new venv would get today: when this
    suite's own venv has exactly those releases (a fresh CI machine's has), the whole suite is
    the newest check and nothing more is built; when it is behind (``.venv`` is kept between
    runs and only reinstalled when pyproject.toml changes), the smoke subset runs on today's."""
    pins = lower_bounds() if deps == "lowest" else []
    python_path = interpreter(python_version)
    if deps == "newest" and python_path == sys.executable:
        newest = newest_versions([str(wheel), *smoke_requirements()], tmp_path / "newest.json")
        ours = {name: metadata.version(name) for name in newest}
        print(f"newest on Python {python_version}: {newest}; this suite's: {ours}")
        if ours == newest:
            return  # this very suite runs on the newest: nothing more to build
    venv = new_venv(python_path, tmp_path / "venv", str(wheel), *smoke_requirements(), *pins)
    python = venv / "bin" / "python"
    versions = installed(python, "celery", "kombu", "redis", "hiredis", "billiard")
    print(f"{deps} on Python {python_version} ({python_path}): {versions}")
    for pin in pins:  # pip installed exactly the lower bounds
        requirement = Requirement(pin)
        assert requirement.specifier.contains(versions[requirement.name]), (pin, versions)
    compile_every_module(python, python_version)
    warnings = [arg for w in SMOKE_WARNINGS for arg in ("-W", w)]
    # on 3 xdist workers, as the suite runs on 4: the smoke subset's wall time is this test's
    options = ["-n", "3", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "inner")]
    output = run(
        [str(python), "-m", "pytest", *options, *warnings, *SMOKE],
        f"the smoke subset on Python {python_version}, {deps} dependencies {versions}",
        timeout=600,
        cwd=REPO_ROOT,
    )
    assert re.search(r"\d+ passed", output), output[-2000:]
