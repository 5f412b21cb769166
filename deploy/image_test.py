"""`make image-test`: the built image, run with buildah on this machine's loopback.

Inside a working container of the image (``buildah run --isolation chroot``: the host's
network and process table, the image's file system and user), it checks:

* ``narwhal --version`` names the compiled build, and no C compiler is in the image;
* two ``narwhal fake-engine`` and the image's own ENTRYPOINT + CMD (``narwhal serve``, with
  ``--host 127.0.0.1 --port N`` added) on a fleet file mounted at ``/etc/narwhal``: /ready
  turns 200 and a streamed completion's tokens arrive here, read with the standard library;
* the image's HEALTHCHECK command exits 0 against that router, and not 0 without one;
* the router runs as the image's user, never root;
* SIGTERM drains: a stream in flight when it arrives ends with ``[DONE]``, and the router
  exits 0.

Standard library only, so it runs with the system's python3. Every address is 127.0.0.1,
every wait has a deadline, and it ends only the processes it started, by pid (``buildah
run`` kills its command instead of passing SIGTERM on, so the router gets its SIGTERM
directly: without a process namespace its pid is the host's).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
MODEL = "fake-model"
START_S = 60.0  # a process of the image to listen, a router to turn ready
STOP_S = 45.0  # the drain: graceful_timeout_s of the fleet file below, and a margin
COMMAND_S = 120.0  # one short command inside the image
COMPILERS = ("gcc", "cc", "c99", "clang", "x86_64-linux-gnu-gcc", "aarch64-linux-gnu-gcc")
FLEET = """\
model = "{model}"

[[engines]]
id = "p0"
url = "http://{host}:{prefill}"
role = "prefill"

[[engines]]
id = "d0"
url = "http://{host}:{decode}"
role = "decode"

[serving]
graceful_timeout_s = 20.0
"""


class Failed(Exception):
    pass


def say(line: str) -> None:
    print(f"image-test: {line}", flush=True)


def check(ok: bool, what: str) -> None:
    if not ok:
        raise Failed(what)
    say(f"ok: {what}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def buildah(*args: str, timeout: float = COMMAND_S) -> str:
    done = subprocess.run(
        ["buildah", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise Failed(f"buildah {' '.join(args)}: exit {done.returncode}\n{done.stderr}")
    return done.stdout


def image_config(image: str) -> dict[str, Any]:
    """The image's Docker config: Entrypoint, Cmd, User, Healthcheck, ExposedPorts, Labels."""
    inspected = json.loads(buildah("inspect", "--type", "image", image))
    config: dict[str, Any] = inspected["Docker"]["config"]
    return config


class Container:
    """A working container of the image; every command runs in it with --isolation chroot."""

    def __init__(self, image: str, mounts: list[str]) -> None:
        self.name = f"narwhal-image-test-{os.getpid()}"
        self.mounts = mounts
        buildah("from", "--quiet", "--pull-never", "--name", self.name, image)

    def argv(self, command: list[str]) -> list[str]:
        volumes = [arg for mount in self.mounts for arg in ("--volume", mount)]
        return ["buildah", "run", "--isolation", "chroot", *volumes, self.name, "--", *command]

    def run(self, command: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(command), capture_output=True, text=True, timeout=COMMAND_S, check=False
        )

    def remove(self) -> None:
        subprocess.run(
            ["buildah", "rm", self.name], capture_output=True, timeout=COMMAND_S, check=False
        )


class Service:
    """One long-running command in the container: the ``buildah run`` this script started,
    and the image's process under it (found by walking that pid's children)."""

    def __init__(self, name: str, container: Container, command: list[str], log: Path) -> None:
        self.name = name
        self.log = log
        self.output = log.open("wb")
        self.proc = subprocess.Popen(
            container.argv(command), stdout=self.output, stderr=subprocess.STDOUT
        )
        self.program = command[0]

    def inner_pid(self) -> int | None:
        """The pid of the command itself: the descendant of our ``buildah run`` that is not
        buildah's own helper (buildah-chroot-runtime, buildah-chroot-exec)."""
        pending, found = [self.proc.pid], list[int]()
        for _ in range(8):  # a handful of levels deep at most
            children: list[int] = []
            for pid in pending:  # buildah is a Go program: any of its threads may fork
                for task in Path(f"/proc/{pid}/task").glob("*"):
                    with contextlib.suppress(OSError):
                        children.extend(int(c) for c in (task / "children").read_text().split())
            for pid in children:
                with contextlib.suppress(OSError):
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    if not Path(argv[0].decode()).name.startswith("buildah"):
                        found.append(pid)
            if found or not children:
                break
            pending = children
        return found[0] if found else None

    def wait_inner_pid(self) -> int:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            pid = self.inner_pid()
            if pid is not None:
                return pid
            if self.proc.poll() is not None:
                raise Failed(f"{self.name} exited {self.proc.returncode}:\n{self.tail()}")
            time.sleep(0.1)
        raise Failed(f"{self.name}: no process under buildah run after {START_S} s")

    def log_lines(self) -> list[dict[str, Any]]:
        """The JSON lines of its output (--log-format json)."""
        self.output.flush()
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                value = json.loads(line)
                if isinstance(value, dict):
                    out.append(value)
        return out

    def tail(self, lines: int = 20) -> str:
        self.output.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float) -> int | None:
        """SIGTERM to the command (buildah run would kill it); its exit status, or None when
        it had to be killed."""
        if self.proc.poll() is None:
            pid = self.inner_pid()
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # our own buildah run: it kills what runs under it
                self.proc.wait(COMMAND_S)
                return None
        return self.proc.returncode


def wait_listening(port: int, service: Service) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if service.proc.poll() is not None:
            raise Failed(f"{service.name} exited {service.proc.returncode}:\n{service.tail()}")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=1):
            return
        time.sleep(0.2)
    raise Failed(f"{service.name} not listening on {HOST}:{port} after {START_S} s")


def get_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def wait_ready(port: int, service: Service) -> float:
    started = time.monotonic()
    deadline = started + START_S
    while time.monotonic() < deadline:
        if service.proc.poll() is not None:
            raise Failed(f"{service.name} exited {service.proc.returncode}:\n{service.tail()}")
        if get_status(f"http://{HOST}:{port}/ready") == 200:
            return time.monotonic() - started
        time.sleep(0.2)
    raise Failed(f"/ready not 200 after {START_S} s:\n{service.tail()}")


@contextlib.contextmanager
def completion_stream(port: int, max_tokens: int) -> Iterator[Iterator[str]]:
    """The ``data:`` payloads of one streamed completion, as they arrive."""
    connection = http.client.HTTPConnection(HOST, port, timeout=30)
    body = {"model": MODEL, "prompt": "the image", "max_tokens": max_tokens, "stream": True}
    try:
        connection.request(
            "POST",
            "/v1/completions",
            body=json.dumps(body),
            headers={"content-type": "application/json"},
        )
        reply = connection.getresponse()
        if reply.status != 200:
            raise Failed(f"POST /v1/completions: {reply.status} {reply.read()[:500]!r}")

        def events() -> Iterator[str]:
            for raw in reply:  # one line at a time, bounded by the stream's end
                line = raw.decode().strip()
                if line.startswith("data:"):
                    yield line.removeprefix("data:").strip()

        yield events()
    finally:
        connection.close()


def read_stream(events: Iterator[str]) -> tuple[list[str], bool]:
    texts: list[str] = []
    done = False
    for data in events:
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise Failed(f"the stream carried an error: {data}")
        texts.extend(choice.get("text", "") for choice in chunk.get("choices", []))
    return texts, done


def run(image: str, work: Path) -> None:
    config = image_config(image)
    entrypoint = list(config.get("Entrypoint") or [])
    cmd = list(config.get("Cmd") or [])
    health = config.get("Healthcheck") or {}
    labels = config.get("Labels") or {}
    user = str(config.get("User") or "")
    say(f"{image}: entrypoint {entrypoint} cmd {cmd} user {user!r}")
    say(f"exposed {sorted(config.get('ExposedPorts') or {})}, labels {labels}")
    check(entrypoint[:2] == ["narwhal", "serve"], "the entrypoint is narwhal serve")
    check(user.split(":")[0] not in ("", "0", "root"), f"the image's user is {user}, not root")
    for key in ("org.opencontainers.image.version", "org.opencontainers.image.source"):
        check(bool(labels.get(key)), f"label {key}={labels.get(key)}")
    probe = list(health.get("Test") or [])
    check(probe[:1] == ["CMD"] and len(probe) > 1, f"a HEALTHCHECK: {probe}")

    ports = {"prefill": free_port(), "decode": free_port(), "router": free_port()}
    etc = work / "etc-narwhal"
    etc.mkdir()
    etc.chmod(0o755)
    fleet = etc / "fleet.toml"
    fleet.write_text(FLEET.format(model=MODEL, host=HOST, **ports))
    fleet.chmod(0o644)
    container = Container(image, [f"{etc}:/etc/narwhal:ro"])
    services: list[Service] = []
    try:
        version = container.run(["narwhal", "--version"])
        say(f"narwhal --version: {(version.stdout + version.stderr).strip()}")
        check(version.returncode == 0, "narwhal --version exits 0")
        check("compiled by mypyc" in version.stdout, "the image runs the compiled build")
        found = container.run(
            ["python3", "-c", f"import shutil; print([shutil.which(c) for c in {COMPILERS!r}])"]
        )
        say(f"compilers on PATH: {found.stdout.strip()}")
        check(found.returncode == 0 and set(eval_list(found.stdout)) == {None}, "no C compiler")

        for role in ("prefill", "decode"):
            extra = ["--itl-s", "0.05"] if role == "decode" else []
            command = ["narwhal", "fake-engine", "--host", HOST, "--port", str(ports[role])]
            services.append(
                Service(
                    f"fake-engine {role}",
                    container,
                    [*command, "--role", role, "--model", MODEL, *extra],
                    work / f"{role}.log",
                )
            )
        for service, role in zip(services, ("prefill", "decode"), strict=True):
            wait_listening(ports[role], service)
        say("the fake engines listen")
        router_argv = [*entrypoint, *cmd, "--host", HOST, "--port", str(ports["router"])]
        say(f"router: {' '.join(router_argv)}")
        router = Service("router", container, router_argv, work / "router.log")
        services.append(router)
        took = wait_ready(ports["router"], router)
        say(f"/ready 200 after {took:.1f} s")

        pid = router.wait_inner_pid()
        status = Path(f"/proc/{pid}/status").read_text()
        uid = next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:"))
        check(uid == user.split(":")[0] and uid != "0", f"the router (pid {pid}) runs as uid {uid}")

        started = time.monotonic()
        with completion_stream(ports["router"], 16) as events:
            texts, done = read_stream(events)
        took = time.monotonic() - started
        say(f"streamed {len(texts)} chunks in {took:.2f} s: {''.join(texts)!r}")
        check(len([t for t in texts if t]) >= 8 and done, "a streamed completion, token by token")

        command = probe[1:]
        env = f"NARWHAL_HEALTH_URL=http://{HOST}:{ports['router']}/health"
        ok = container.run(["env", env, *command])
        check(ok.returncode == 0, f"the HEALTHCHECK command exits 0 {ok.stderr[-200:]}".strip())
        nobody = f"NARWHAL_HEALTH_URL=http://{HOST}:{free_port()}/health"
        refused = container.run(["env", nobody, *command])
        check(refused.returncode != 0, f"... and {refused.returncode} with no router there")

        # SIGTERM with a stream in flight: the stream ends whole, the router exits 0
        with completion_stream(ports["router"], 60) as events:
            first = next(events)
            say(f"in flight: {first[:80]}...; SIGTERM to the router, pid {pid}")
            os.kill(pid, signal.SIGTERM)
            drain_started = time.monotonic()
            texts, done = read_stream(events)
        chunks = 1 + len(texts)
        check(done, f"the stream in flight ended with [DONE] ({chunks} chunks)")
        code = router.proc.wait(STOP_S)
        say(f"router exited {code}, {time.monotonic() - drain_started:.1f} s after SIGTERM")
        check(code == 0, "SIGTERM drains and the router exits 0")
        logged = [line for line in router.log_lines() if line.get("logger") == "narwhal.requests"]
        last = logged[-1] if logged else {}
        check(
            last.get("outcome") == "completed" and last.get("tokens") == 60,
            f"the router logged the drained request completed with all its tokens: {last}",
        )
        say("router log (last lines):\n" + router.tail(8))
    finally:
        for service in reversed(services):
            stopped = service.stop(STOP_S)
            if service.name != "router":
                say(f"{service.name} stopped: exit {stopped}")
        container.remove()


def eval_list(text: str) -> list[str | None]:
    value = ast.literal_eval(text.strip())
    assert isinstance(value, list)
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", required=True, help="the image to test (make image's tag)")
    args = parser.parse_args()
    if shutil.which("buildah") is None:
        say("buildah is missing (apt-get install buildah)")
        return 1
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="narwhal-image-test-") as tmp:
        work = Path(tmp)
        work.chmod(0o755)
        try:
            run(args.image, work)
        except (Failed, subprocess.TimeoutExpired, OSError) as exc:
            say(f"FAILED: {exc}")
            for log in sorted(work.glob("*.log")):
                say(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}")
            return 1
    say(f"passed in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
