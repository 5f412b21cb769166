"""Create a tiny Llama-architecture model folder with NO downloaded weights.

Writes config.json, generation_config.json, tokenizer.json, tokenizer_config.json and
special_tokens_map.json into OUT. No weights: vLLM starts with --load-format dummy.
Tokenizer: a byte-level BPE trained locally (tokenizers package) on text files on this disk.
"""

import glob
import json
import os
import sys
import sysconfig

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

OUT = sys.argv[1]
VOCAB = 2048
os.makedirs(OUT, exist_ok=True)


def dump(name: str, value: object) -> None:
    with open(os.path.join(OUT, name), "w") as f:
        json.dump(value, f, indent=2)


files = sorted(glob.glob("/usr/share/common-licenses/*"))
files += sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:200]
files = [f for f in files if os.path.isfile(f)]

tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
specials = ["<s>", "</s>", "<pad>"]
trainer = trainers.BpeTrainer(
    vocab_size=VOCAB,
    special_tokens=specials,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
)
tok.train(files, trainer)
bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
tok.post_processor = processors.TemplateProcessing(
    single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
)
tok.save(os.path.join(OUT, "tokenizer.json"))
vocab_size = tok.get_vocab_size()

chat_template = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
dump(
    "tokenizer_config.json",
    {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "model_max_length": 4096,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    },
)
dump("special_tokens_map.json", {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
dump(
    "config.json",
    {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": tok.token_to_id("<pad>"),
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
    },
)
dump("generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
print("wrote", OUT, "vocab", vocab_size, "files", len(files))
