"""`pip install celery-singleton-lock` alone runs the README's example: a fresh venv, no extras.

The wheel of this checkout is built, installed with no extras (its dependencies from the package
registry) into a venv of its own, and the README's "Ten lines" example, taken from README.md,
runs there against a private Redis: a real ``celery worker`` and the caller both use the fresh
venv's python, and see neither this checkout nor the test run's virtualenv.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import redis

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


def run(args: list[str], what: str, timeout: float) -> None:
    """Run ``args`` to completion (without PYTHONPATH); fail with its output unless it exits 0."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run(
        args,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, f"{what} exited with {proc.returncode}:\n{proc.stdout}"


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new venv holding the wheel of this checkout, installed with no extras."""
    wheels = tmp_path_factory.mktemp("wheel")
    pip = ["-m", "pip", "--disable-pip-version-check"]
    run(
        [sys.executable, *pip, "wheel", "--no-deps", "-w", str(wheels), str(REPO_ROOT)],
        "building the wheel",
        timeout=300,
    )
    (wheel,) = wheels.glob("celery_singleton_lock-*.whl")
    venv = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", str(venv)], "python -m venv", timeout=120)
    python = venv / "bin" / "python"
    run([str(python), *pip, "install", str(wheel)], "pip install <wheel>", timeout=300)
    return venv


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
