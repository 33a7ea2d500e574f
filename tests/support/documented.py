"""What the documentation shows, read from it, for the tests that must agree with it (a
documented example that stopped working fails a test, not a user)."""

from __future__ import annotations

from tests.support.zygote import REPO_ROOT

__test__ = False


def documented_acl_commands() -> list[str]:
    """The ``+command`` rules of the ACL SETUSER example in docs/deployments.md."""
    text = (REPO_ROOT / "docs" / "deployments.md").read_text(encoding="utf-8")
    example = text.split("ACL SETUSER celery-locks", 1)[1].split("```", 1)[0]
    rules = [word for word in example.split() if word.startswith("+")]
    assert "+evalsha" in rules
    return rules


def documented_python(page: str, section: str) -> str:
    """The first ``python`` block of ``section`` (a heading's text) in ``docs/<page>``."""
    return documented_block(page, section, "python")


def documented_block(page: str, section: str, language: str) -> str:
    """The first ``language`` block of ``section`` (a heading's text) in ``docs/<page>``."""
    text = (REPO_ROOT / "docs" / page).read_text(encoding="utf-8")
    after = text.split(f"\n{section}\n", 1)[1]
    return after.split(f"```{language}\n", 1)[1].split("```", 1)[0]
