"""The per-token path as it runs: every function the router calls once per token, counted
by a profiler over a long stream, grouped by module.

    python bench/token_path_calls.py [--tokens N] [--root PATH]

Two fake engines (``narwhal fake-engine``, their own processes) and the router, pure Python
(NARWHAL_PURE=1: compiled functions do not show in a profile); one client streams one
completion of ``--tokens`` tokens, paced at 2 ms a token so that each comes in a read of its
own, and the router's profiler (``cProfile``) runs only while it does (SIGUSR1 starts it,
SIGUSR2 stops it and writes the profile). A function called at least ``0.9 x tokens``
times is on the per-token path (a function called twice a token shows ``2.0``).
``--root``: measure another checkout's narwhal instead (an A/B of the path).
Nothing here is asserted: it reports what one run counted.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import peers  # bench/ is not a package: found through the path above

PER_TOKEN = 0.9  # calls per token that put a function on the path
ITL_S = 0.002


AS_ROUTER = "--as-router"


def serve_profiled() -> None:
    """The router's process: a profiler that SIGUSR1 starts and SIGUSR2 stops and writes."""
    profile, profiler = sys.argv[2], cProfile.Profile()

    def start(_signum: int, _frame: object) -> None:
        profiler.enable()

    def stop(_signum: int, _frame: object) -> None:
        profiler.disable()
        profiler.dump_stats(profile + ".part")
        os.rename(profile + ".part", profile)  # whole, or not there

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    sys.argv = ["narwhal", *sys.argv[3:]]
    from narwhal.process.cli import main as narwhal_main

    narwhal_main()


def _router(fleet: Path, tmp: Path, root: str | None) -> tuple[subprocess.Popen[bytes], str]:
    env = {**os.environ, "NARWHAL_PURE": "1"}
    if root is not None:
        env["PYTHONPATH"] = str(Path(root).absolute())
    argv = [sys.executable, str(Path(__file__).absolute()), AS_ROUTER, str(tmp / "router.prof")]
    argv += ["serve", "--config", str(fleet), "--port", "0", "--log-level", "warning"]
    log = (tmp / "router.log").open("w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=root, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # bounded: the router announces its URL at once
        text = (tmp / "router.log").read_text()
        found = peers.URL.search(text)
        if found:
            return proc, found.group(1)
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the router never announced its URL: {text[-2000:]}")


def _profiled(router: subprocess.Popen[bytes], url: str, tokens: int, profile: Path) -> int:
    """One stream under the router's profiler; the bytes the client read."""
    router.send_signal(signal.SIGUSR1)
    time.sleep(0.5)  # the handler runs at the router's next bytecode: well within this
    read = _stream(url, tokens)
    router.send_signal(signal.SIGUSR2)
    deadline = time.monotonic() + 60
    while not profile.exists():  # bounded: written between two events
        if time.monotonic() > deadline:
            raise RuntimeError("the router wrote no profile")
        time.sleep(0.2)
    return read


def _stream(url: str, tokens: int) -> int:
    """One streamed completion over a raw socket; the bytes read."""
    host, port = url.removeprefix("http://").split(":")
    body = (
        b'{"model":"%s","prompt":"hello there","max_tokens":%d,"stream":true,'
        b'"ignore_eos":true}' % (peers.MODEL.encode(), tokens)
    )
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
    )
    total = 0
    with socket.create_connection((host, int(port)), timeout=120) as sock:
        sock.sendall(head + body)
        while True:  # bounded by the socket's timeout and the stream's end
            data = sock.recv(65536)
            if not data:
                return total
            total += len(data)


def per_token(profile: Path, tokens: int) -> dict[str, list[tuple[str, float]]]:
    """The functions called at least ``PER_TOKEN`` times a token, by file."""
    stats = pstats.Stats(str(profile))
    found: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for (path, line, name), (_, calls, *_rest) in stats.stats.items():  # type: ignore[attr-defined]
        ratio = calls / tokens
        if ratio >= PER_TOKEN and not path.startswith("~"):
            short = path.split("site-packages/")[-1].split("/narwhal/", 1)[-1]
            found[short].append((f"{name}:{line}", ratio))
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--root", help="another checkout's narwhal, measured instead")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        procs, urls = peers.start_fake_fleet(
            [("p0", "prefill", []), ("d0", "decode", ["--itl-s", str(ITL_S)])], tmp
        )
        try:
            fleet = tmp / "fleet.toml"
            fleet.write_text(
                f'model = "{peers.MODEL}"\n'
                + peers.engines_toml([urls["p0"]], [urls["d0"]])
                + "[engine]\nfirst_token_timeout_s = 60.0\n"
            )
            router, url = _router(fleet, tmp, args.root)
            try:
                _stream(url, 20)  # warm: connections, first-time paths
                read = _profiled(router, url, args.tokens, tmp / "router.prof")
            finally:
                router.send_signal(signal.SIGTERM)
                router.wait(timeout=60)
            found = per_token(tmp / "router.prof", args.tokens)
        finally:
            for proc in procs:
                proc.stop()
    functions = sum(len(v) for v in found.values())
    print(
        f"streamed {args.tokens} tokens ({read} bytes); per-token path: {functions} "
        f"functions in {len(found)} modules (called >= {PER_TOKEN} times a token)\n"
    )
    print("| module | functions | calls per token each |")
    print("|---|---|---|")
    for module in sorted(
        found,
        key=lambda m: (
            not m.startswith(
                (
                    "router",
                    "stream",
                    "engines",
                    "frontdoor",
                    "lowlevel/fast_io",
                    "observe/metrics",
                    "core",
                )
            ),
            m,
        ),
    ):
        names = ", ".join(f"`{n}` {r:.1f}" for n, r in sorted(found[module]))
        print(f"| {module} | {len(found[module])} | {names} |")


if __name__ == "__main__":
    if sys.argv[1:2] == [AS_ROUTER]:
        serve_profiled()
    else:
        main()
