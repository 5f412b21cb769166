"""One vLLM engine started by a standalone probe (``reclaim_probe.py``, ``resume_probe.py``),
as ``conftest.py`` starts them: ``serve_nixl.sh`` in its own session, its output in a log,
ended by its own process group. Stdlib only, imported as a sibling (``ports.py`` too)."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

from ports import free_port, http, start_in_session, stop_group

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


class ProbeEngine:
    """``extra``: arguments after ``serve_nixl.sh``'s own (the last of a flag wins)."""

    def __init__(
        self,
        name: str,
        role: str,
        vllm_dir: Path,
        logs: Path,
        extra: list[str],
        env: dict[str, str],
    ) -> None:
        self.name, self.role = name, role
        self.port, self.side = free_port(), free_port()
        self.log = logs / f"{name}.log"
        self.argv = ["bash", str(HERE / "serve_nixl.sh"), str(vllm_dir)]
        self.argv += [str(self.port), str(self.side), role, *extra]
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = start_in_session(self.argv, self.log, self.env, ROOT)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def wait_ready(self, deadline: float) -> str:
        """'' when ready, 'clash' on a taken port, else an error."""
        while time.monotonic() < deadline:
            assert self.proc is not None
            if "Address already in use" in self.log_text():
                return "clash"
            if self.proc.poll() is not None:
                return f"{self.name} exited with {self.proc.returncode}"
            with contextlib.suppress(OSError):
                if http("GET", self.url + "/health", timeout=5)[0] == 200:
                    return ""
            time.sleep(1.0)  # bounded by deadline
        return f"{self.name} not ready"

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)
            self.proc = None
