"""The README is the newcomer's entry point: its first commands and its configuration
reference must stay true to the project."""

from __future__ import annotations

import re
from pathlib import Path

from manager.config import KvtierConfig

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_readme_opens_with_the_run_and_test_commands() -> None:
    first_block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert first_block and README.index("```bash") < 20, "the README must open with commands"
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands[:2] == ["make run", "make test"]
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^run: ", makefile, re.M) and re.search(r"^test: ", makefile, re.M)


def test_ci_runs_the_readme_test_command() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M)


def test_every_configuration_key_is_documented() -> None:
    section = README[README.index("## Configuration"):README.index("## Admin API")]
    missing = []
    for name, field in KvtierConfig.model_fields.items():
        sub = getattr(field.annotation, "model_fields", None)
        if sub is None:
            if f"{name} =" not in section:
                missing.append(name)
            continue
        if f"[{name}]" not in section:
            missing.append(f"[{name}]")
        missing += [f"{name}.{key}" for key in sub if not re.search(rf"\b{key} =", section)]
    assert not missing, f"configuration keys missing from the README: {missing}"
