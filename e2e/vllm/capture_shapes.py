"""Record what real vLLM 0.32 answers for the OpenAI request shapes the router must carry
whole (issue "nothing the client asked for is lost"): each shape sent to one local engine
streamed and not, at temperature 0, written to ``tests/captures/shapes/``.

    python e2e/vllm/capture_shapes.py [--vllm ~/.cache/narwhal-vllm] [--out tests/captures/shapes]

Starts one engine (``serve_nixl.sh``, role kv_both, the tiny dummy-weights model) on
127.0.0.1, sends every shape, stops it. ``tests/unit/stream/test_shape_captures.py`` replays the
streamed captures through the router's relay and assembler and compares the result with
the non-streamed capture, field by field.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODEL = "tiny"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CHAT = [{"role": "user", "content": "What is the weather in Paris for the next days?"}]
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"

# name -> (endpoint, body); every shape at temperature 0 unless it says otherwise
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "completion_plain": ("completions", {"prompt": PROMPT, "max_tokens": 8}),
    "chat_plain": ("chat/completions", {"messages": CHAT, "max_tokens": 8}),
    "chat_named_tool": (
        "chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 40,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    ),
    "chat_required_tool": (
        "chat/completions",
        {"messages": CHAT, "max_tokens": 60, "tools": [WEATHER], "tool_choice": "required"},
    ),
    "chat_logprobs": (
        "chat/completions",
        {"messages": CHAT, "max_tokens": 6, "logprobs": True, "top_logprobs": 3},
    ),
    "completion_logprobs": ("completions", {"prompt": PROMPT, "max_tokens": 6, "logprobs": 2}),
    "completion_echo_logprobs": (
        "completions",
        {"prompt": PROMPT, "max_tokens": 4, "echo": True, "logprobs": 1},
    ),
    "completion_prompt_logprobs": (
        "completions",
        {"prompt": PROMPT, "max_tokens": 4, "prompt_logprobs": 1},
    ),
    "chat_stop": ("chat/completions", {"messages": CHAT, "max_tokens": 16, "stop": ["e", "a"]}),
    "completion_stop": ("completions", {"prompt": PROMPT, "max_tokens": 16, "stop": ["e"]}),
    "chat_json_schema": (
        "chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 40,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": WEATHER["function"]["parameters"]},
            },
        },
    ),
    "completion_seed": (
        "completions",
        {"prompt": PROMPT, "max_tokens": 6, "seed": 7, "temperature": 0.8},
    ),
    "chat_usage": (
        "chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 5,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ),
    # vLLM refuses n > 1 with greedy sampling: sampled, with a seed (the same both ways)
    "completion_n2": (
        "completions",
        {"prompt": PROMPT, "max_tokens": 5, "n": 2, "temperature": 0.7, "seed": 3},
    ),
    "chat_n2": (
        "chat/completions",
        {"messages": CHAT, "max_tokens": 5, "n": 2, "temperature": 0.7, "seed": 3},
    ),
    "completion_n2_greedy": ("completions", {"prompt": PROMPT, "max_tokens": 5, "n": 2}),
    "completion_three_prompts": (
        "completions",
        {"prompt": ["One two three", "Four five six", "Seven eight nine"], "max_tokens": 4},
    ),
    "completion_max_tokens_1": ("completions", {"prompt": PROMPT, "max_tokens": 1}),
    "chat_max_tokens_1": ("chat/completions", {"messages": CHAT, "max_tokens": 1}),
    "completion_token_ids": ("completions", {"prompt": [1, 45, 99, 173], "max_tokens": 5}),
    "chat_system": (
        "chat/completions",
        {
            "messages": [{"role": "system", "content": "Be brief."}, *CHAT],
            "max_tokens": 6,
            "presence_penalty": 0.5,
        },
    ),
}


def post(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_healthy(url: str, proc: subprocess.Popen[bytes], budget_s: float) -> None:
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the engine exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)  # bounded by budget_s: an engine loading its model
    raise SystemExit(f"the engine was not healthy within {budget_s:.0f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", default=str(Path.home() / ".cache" / "narwhal-vllm"))
    parser.add_argument("--out", default=str(HERE.parent.parent / "tests/captures/shapes"))
    parser.add_argument("--port", type=int, default=21871)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "engine.log", "wb")  # noqa: SIM115 - the engine writes it while we run
    argv = ["bash", str(HERE / "serve_nixl.sh"), args.vllm, str(args.port), str(args.port + 1)]
    # named and required tool choice need a tool-call parser (vLLM 0.32 refuses them without)
    tools = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    proc = subprocess.Popen([*argv, "kv_both", *tools], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_healthy(url, proc, 600)
        for name, (endpoint, shape) in SHAPES.items():
            body = {"model": MODEL, "temperature": 0, **shape}
            plain = {k: v for k, v in body.items() if k != "stream_options"}
            status, raw = post(f"{url}/v1/{endpoint}", {**plain, "stream": False})
            (out / f"{name}.json").write_bytes(raw)
            stream = {**body, "stream": True}
            stream.setdefault("stream_options", {"include_usage": True})
            s_status, s_raw = post(f"{url}/v1/{endpoint}", stream)
            (out / f"{name}.sse").write_bytes(s_raw)
            (out / f"{name}.request.json").write_text(
                json.dumps({"endpoint": endpoint, "body": body}, indent=1)
            )
            print(f"{name}: {status} / streamed {s_status}", file=sys.stderr)
    finally:
        proc.terminate()  # serve_nixl.sh execs vllm: the engine itself gets SIGTERM
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


if __name__ == "__main__":
    main()
