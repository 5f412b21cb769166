"""The deploy files and Prometheus's own tools, shared by the deploy and Prometheus tests."""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import pytest
import trio
import yaml

from tests.support.paths import ROOT

DEPLOY = ROOT / "deploy"


ALERTS = DEPLOY / "alerts.yml"


def prometheus_tool(name: str) -> str:
    """A binary of Debian's prometheus package (``promtool``, ``prometheus``); skipped when
    absent, except in CI, which installs it."""
    found = shutil.which(name)
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail(f"{name} is not installed: .ci/run installs Debian's prometheus package")
    pytest.skip(f"{name} not installed (apt-get install prometheus)")


def promtool() -> str:
    return prometheus_tool("promtool")


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def alert_job() -> str:
    jobs = {m for rule in alert_rules() for m in re.findall(r'job="([^"]+)"', rule["expr"])}
    (job,) = jobs
    return job


async def lint_exposition(text: bytes) -> tuple[int, str]:
    """``promtool check metrics`` on an exposition: its exit status and what it said (a
    clean exposition is ``(0, "")``: no problem, not even a warning)."""
    done = await trio.run_process(
        [promtool(), "check", "metrics"],
        stdin=text,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    return done.returncode, (done.stdout + done.stderr).decode().strip()
