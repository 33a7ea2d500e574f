"""The README and docs/configuration.md stay in step with the code.

- every setting of ``config.SETTINGS`` is documented with both spellings and its default;
- every signal of ``celery_singleton_lock.signals`` is documented;
- the fixed part of every ``singleton: ...`` log message in the package is listed under
  "Log lines", and that list names no message the code no longer has;
- the README's first code block holds exactly the demo and the test command, and ``.ci/run``
  runs the second one.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from pathlib import Path

import pytest

from celery_singleton_lock import signals
from celery_singleton_lock.config import SETTINGS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "celery_singleton_lock"
CONFIGURATION = ROOT / "docs" / "configuration.md"
README = ROOT / "README.md"
LOG_PREFIX = "singleton: "


def configuration() -> str:
    return CONFIGURATION.read_text(encoding="utf-8")


def fixed_part(message: str, placeholders: str) -> str:
    """The message up to its first placeholder character, without trailing blanks."""
    cut = min((i for i in (message.find(c) for c in placeholders) if i >= 0), default=None)
    return message[:cut].rstrip()


def code_log_messages() -> dict[str, str]:
    """Fixed part of every ``singleton: ...`` string literal in the package -> where it is."""
    found: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            text: str | None = None
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value.startswith(LOG_PREFIX):
                    text = fixed_part(node.value, "%{")
            elif isinstance(node, ast.JoinedStr) and node.values:
                first = node.values[0]
                if (
                    isinstance(first, ast.Constant)
                    and isinstance(first.value, str)
                    and first.value.startswith(LOG_PREFIX)
                ):
                    text = fixed_part(first.value, "%{")
            if text is not None:
                found.setdefault(text, f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}")
    return found


def documented_log_messages() -> set[str]:
    """Fixed part of every message in the "Log lines" table of the configuration page."""
    section = configuration().split("\n## Log lines", 1)[1].split("\n## ", 1)[0]
    messages = set()
    for line in section.splitlines():
        if not line.startswith("|"):
            continue
        match = re.search(r"`(singleton: [^`]*)`", line)
        if match:
            messages.add(fixed_part(match.group(1), "<"))
    return messages


def readme_first_block() -> list[str]:
    """Non-empty lines of the README's first fenced code block."""
    lines: list[str] = []
    inside = False
    for line in README.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            if inside:
                break
            inside = True
            continue
        if inside and line.strip():
            lines.append(line)
    return lines


def strip_comment(line: str) -> str:
    return re.sub(r"\s+#.*$", "", line).strip()


# -- settings and signals ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_every_setting_is_documented_with_both_spellings(name: str) -> None:
    text = configuration()
    assert f"singleton_{name}" in text, f"add singleton_{name} to docs/configuration.md"
    assert f"CELERY_SINGLETON_{name.upper()}" in text, (
        f"add the namespace spelling CELERY_SINGLETON_{name.upper()} to docs/configuration.md"
    )


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_every_setting_row_shows_its_default(name: str) -> None:
    rows = [
        line for line in configuration().splitlines() if line.startswith(f"| `singleton_{name}`")
    ]
    assert rows, f"docs/configuration.md needs a table row starting with | `singleton_{name}`"
    default = SETTINGS[name].default
    if default is None:
        expected = "`None`"
    elif isinstance(default, str):
        expected = f'`"{default}"`'
    else:
        expected = f"`{default!r}`"
    assert expected in rows[0], f"the row of singleton_{name} should show its default {expected}"


@pytest.mark.parametrize("name", sorted(signals.__all__))
def test_every_signal_is_documented(name: str) -> None:
    assert f"`{name}`" in configuration(), f"document signal {name} in docs/configuration.md"


# -- log lines -----------------------------------------------------------------------------


def test_the_package_has_log_messages_to_check() -> None:
    assert len(code_log_messages()) >= 10  # the parser still finds them


def test_every_log_message_is_documented() -> None:
    text = configuration()
    missing = {msg: where for msg, where in code_log_messages().items() if msg not in text}
    assert not missing, f"add these log lines to docs/configuration.md: {missing}"


def test_documented_log_messages_exist_in_the_code() -> None:
    stale = documented_log_messages() - set(code_log_messages())
    assert not stale, f"docs/configuration.md lists log lines the code no longer has: {stale}"


# -- README and CI -------------------------------------------------------------------------


def test_readme_opens_with_the_demo_and_the_test_command() -> None:
    block = readme_first_block()
    assert [strip_comment(line) for line in block] == ["./run demo", "./run test"]
    assert all("#" in line for line in block), "each command says what it does in a comment"


def test_ci_runs_the_readme_test_command() -> None:
    env = {**os.environ, "CI_RUN_DRY": "1"}
    result = subprocess.run(
        ["bash", str(ROOT / ".ci" / "run")],
        cwd="/",  # .ci/run must find the repository by itself
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"+ {strip_comment(readme_first_block()[1])}"


@pytest.mark.parametrize("script", ["run", ".ci/run"])
def test_entry_scripts_are_executable(script: str) -> None:
    path = ROOT / script
    assert os.access(path, os.X_OK), f"chmod +x {script}"
    assert path.read_text(encoding="utf-8").startswith("#!/usr/bin/env bash")
