"""Write a LoRA adapter for the tiny model (make_tiny_model.py) in PEFT's format.

Usage: make_tiny_lora.py MODEL_DIR OUT [--scale S]   (run with the vLLM environment's Python:
torch and safetensors are there)

OUT gets adapter_config.json and adapter_model.safetensors: rank 8 on every layer's
``q_proj`` and ``v_proj``, both factors random (a fixed seed: the same bytes every time).
PEFT starts ``lora_B`` at zero, which would leave the model as it is; the suite needs an
adapter whose greedy text differs from the base model's. The base runs on vLLM's dummy
weights (uniform in +-1e-3), so the factors are scaled to dominate them (measured on
vLLM 0.32 CPU, greedy, 32 tokens: at 0.01 to 1 the adapter's text equals the base's, at 3
it differs late in one prompt of four, at 10 from the first tokens on every one).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import save_file

RANK = 8
ALPHA = 16
SEED = 0
SCALE = 10.0
TARGETS = ("q_proj", "v_proj")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--scale", type=float, default=SCALE)
    args = parser.parse_args()
    with open(os.path.join(args.model, "config.json")) as f:
        config = json.load(f)
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    out_features = {
        "q_proj": config["num_attention_heads"] * head_dim,
        "v_proj": config["num_key_value_heads"] * head_dim,
    }
    generator = torch.Generator().manual_seed(SEED)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config["num_hidden_layers"]):
        for module in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = torch.randn(RANK, hidden, generator=generator) * args.scale
            b = torch.randn(out_features[module], RANK, generator=generator) * args.scale
            tensors[prefix + ".lora_A.weight"] = a.contiguous()
            tensors[prefix + ".lora_B.weight"] = b.contiguous()
    os.makedirs(args.out, exist_ok=True)
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": os.path.abspath(args.model),
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    # written under temporary names, then renamed: a half-written adapter is never taken
    weights = os.path.join(args.out, "adapter_model.safetensors")
    save_file(tensors, weights + ".tmp", metadata={"format": "pt"})
    with open(os.path.join(args.out, "adapter_config.json.tmp"), "w") as f:
        json.dump(adapter, f, indent=2)
    os.replace(weights + ".tmp", weights)
    os.replace(
        os.path.join(args.out, "adapter_config.json.tmp"),
        os.path.join(args.out, "adapter_config.json"),
    )
    print("wrote", args.out, "rank", RANK, "scale", args.scale, "tensors", len(tensors))


if __name__ == "__main__":
    main()
