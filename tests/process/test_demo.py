"""`narwhal demo` streams one chat with narwhal's own dependencies only: run with every
test-only package made unimportable, as after a plain `pip install narwhal`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

TEST_ONLY = ("openai", "httpx", "httpcore", "aiohttp", "pytest", "hypothesis", "trustme")


def test_the_demo_needs_no_test_dependency(tmp_path: Path) -> None:
    for name in TEST_ONLY:  # shadows the installed package: importing it fails
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"raise ImportError('narwhal demo must not need {name}')\n"
        )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "narwhal", "demo", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stdout.splitlines()
    assert re.fullmatch(r"request id: [0-9a-f]{16}", lines[0]), lines
    assert len(lines[1].split()) > 10  # the streamed tokens (24, some without a space)
    assert lines[2].startswith("prefill served by engine ")
    assert lines[3].startswith("decode served by engine ")
