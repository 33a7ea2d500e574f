"""Finding an interpreter of a Python version (tests/support/pythons.py), on made-up PATHs and
pyenv roots holding real executables: links to this very interpreter, a shim that refuses, a
script that says another version, a ``pyenv`` that prints its root."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.pythons import find_python, looked_in, pyenv_root

#: the version of this interpreter, which the links below stand for
HERE = f"{sys.version_info.major}.{sys.version_info.minor}"


def executable(path: Path, script: str | None = None) -> Path:
    """A link to this interpreter at ``path``, or a shell script of ``script``'s lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if script is None:
        path.symlink_to(sys.executable)
    else:
        path.write_text(f"#!/bin/sh\n{script}\n")
        path.chmod(0o755)
    return path


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A machine with an empty PATH (``<tmp>/bin``), an empty home and no $PYENV_ROOT."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PYENV_ROOT", raising=False)
    return tmp_path


def test_an_interpreter_on_path_comes_first(machine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python3.X`` on PATH is taken when it runs, before pyenv's."""
    on_path = executable(machine / "bin" / f"python{HERE}")
    executable(machine / "pyenv" / "versions" / f"{HERE}.1" / "bin" / f"python{HERE}")
    monkeypatch.setenv("PYENV_ROOT", str(machine / "pyenv"))
    assert find_python(HERE) == on_path


def test_a_refusing_shim_on_path_falls_back_to_pyenvs_newest_patch(
    machine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pyenv shim on PATH that refuses the version (pyenv has it, not selected) and one that
    says another version are passed over; under pyenv, the newest final release is taken
    (3.X.10 over 3.X.9, whatever the sorting of names), not a pre-release, a free-threaded or a
    dev build."""
    refusal = f"echo 'pyenv: python{HERE}: command not found'; exit 127"
    executable(machine / "bin" / f"python{HERE}", refusal)
    versions = machine / "pyenv" / "versions"
    for name in ("9", "10"):
        executable(versions / f"{HERE}.{name}" / "bin" / f"python{HERE}")
    for name in (f"{HERE}.11rc1", f"{HERE}.12t", f"{HERE}-dev"):
        executable(versions / name / "bin" / f"python{HERE}")
    monkeypatch.setenv("PYENV_ROOT", str(machine / "pyenv"))
    assert find_python(HERE) == versions / f"{HERE}.10" / "bin" / f"python{HERE}"

    (machine / "bin" / f"python{HERE}").unlink()
    executable(machine / "bin" / f"python{HERE}", "echo 2.7")
    assert find_python(HERE) == versions / f"{HERE}.10" / "bin" / f"python{HERE}"


def test_pyenv_root_from_the_environment_pyenv_or_home(
    machine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The root is ``$PYENV_ROOT``, else what ``pyenv root`` prints, else ``~/.pyenv``; an
    interpreter under the default root is found."""
    assert pyenv_root() == machine / "home" / ".pyenv"
    under_home = executable(
        machine / "home" / ".pyenv" / "versions" / f"{HERE}.3" / "bin" / f"python{HERE}"
    )
    assert find_python(HERE) == under_home

    executable(machine / "bin" / "pyenv", f"echo {machine / 'said'}")
    assert pyenv_root() == machine / "said"
    monkeypatch.setenv("PYENV_ROOT", str(machine / "set"))
    assert pyenv_root() == machine / "set"


def test_a_missing_version_is_none_and_says_where_it_was_looked_for(
    machine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing on PATH nor under pyenv: None, and the message names the command and the
    directory."""
    monkeypatch.setenv("PYENV_ROOT", str(machine / "pyenv"))
    executable(machine / "pyenv" / "versions" / "3.9.1" / "bin" / "python3.9")
    assert find_python("3.99") is None
    assert looked_in("3.99") == (
        f"no python3.99 on PATH nor under pyenv ({machine / 'pyenv' / 'versions'}/3.99.*)"
    )
