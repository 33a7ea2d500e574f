"""Finding an interpreter of a Python version (``3.12``) the way a contributor's machine has one.

``python3.12`` on PATH first, else pyenv's newest 3.12.Z: ``<root>/versions/3.12.Z/bin/python3.12``,
the root being ``$PYENV_ROOT``, else what ``pyenv root`` prints, else ``~/.pyenv``. A candidate
counts only if it runs and says it is that version: a pyenv shim on PATH for a version pyenv has
installed but not selected exits with "pyenv: python3.12: command not found", and is passed over
for the interpreter under pyenv's ``versions`` directory. Only final releases count there
(``3.12.4``, not ``3.12.0rc1``, ``3.13.0t`` or ``3.12-dev``), the newest patch first.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

__test__ = False

#: what a candidate runs to say its version: ``3.12``
SAYS_VERSION = "import sys; print('%d.%d' % sys.version_info[:2])"


def find_python(version: str) -> Path | None:
    """An interpreter of ``version`` (``"3.12"``) that runs: ``python<version>`` on PATH, else
    the newest patch release under pyenv; None when there is none (:func:`looked_in` says
    where it was looked for)."""
    on_path = shutil.which(f"python{version}")
    candidates = [Path(on_path)] if on_path else []
    candidates += under_pyenv(version)
    return next((c for c in candidates if runs_as(c, version)), None)


def looked_in(version: str) -> str:
    """Where :func:`find_python` looks for ``version``, for a message saying it found none."""
    return f"no python{version} on PATH nor under pyenv ({pyenv_root() / 'versions'}/{version}.*)"


def pyenv_root() -> Path:
    """``$PYENV_ROOT``, else the output of ``pyenv root`` when pyenv is on PATH, else
    ``~/.pyenv`` (pyenv's default)."""
    if os.environ.get("PYENV_ROOT"):
        return Path(os.environ["PYENV_ROOT"])
    pyenv = shutil.which("pyenv")
    if pyenv is not None:
        said = subprocess.run(
            [pyenv, "root"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if said.returncode == 0 and said.stdout.strip():
            return Path(said.stdout.strip())
    return Path.home() / ".pyenv"


def under_pyenv(version: str) -> list[Path]:
    """``<root>/versions/<version>.Z/bin/python<version>`` of every final release pyenv has
    installed, the newest patch first (``3.12.10`` before ``3.12.9``)."""
    release = re.compile(rf"{re.escape(version)}\.(\d+)")
    found = []
    for directory in (pyenv_root() / "versions").glob(f"{version}.*"):
        patch = release.fullmatch(directory.name)
        executable = directory / "bin" / f"python{version}"
        if patch is not None and executable.is_file():
            found.append((int(patch.group(1)), executable))
    return [executable for _, executable in sorted(found, reverse=True)]


def runs_as(candidate: Path, version: str) -> bool:
    """Whether ``candidate`` starts and says it is Python ``version`` (run without this
    process's PYTHONPATH or PYTHONHOME, which may be another version's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    try:
        said = subprocess.run(
            [str(candidate), "-c", SAYS_VERSION],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except OSError:  # not executable, or a script with a missing interpreter
        return False
    return said.returncode == 0 and said.stdout.strip() == version
