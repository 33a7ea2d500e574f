"""``celery -A <app> singleton ...`` as a real process, the way an operator runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping

from tests.support.workers import REPO_ROOT

__test__ = False


def singleton_cli(
    app: str, env: Mapping[str, str], *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``celery -A <app> singleton <args>`` with ``env`` over this process's environment."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", app, "singleton", *args],
        cwd=REPO_ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def app_env(redis_url: str, prefix: str) -> dict[str, str]:
    """The environment the test apps read their Redis and prefix from."""
    return {"SINGLETON_TEST_REDIS_URL": redis_url, "SINGLETON_TEST_PREFIX": prefix}
