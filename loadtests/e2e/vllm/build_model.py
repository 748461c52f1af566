"""Build the tiny test model: a small Llama config (dummy weights) and a local BPE tokenizer.

There is no model hub here, so the model directory is made from scratch: a byte-level BPE
tokenizer trained with `tokenizers` on the Python standard library's source (present on
every machine with this interpreter, so the build is reproducible), a ChatML/Hermes-style
chat template that renders tools and tool calls (vLLM's `hermes` tool parser needs the
`<tool_call>` tokens), and a Llama config. vLLM runs it with `--load-format dummy`, so no
weights are written: outputs are noise, but prefill cost, the KV cache, prefix caching and
KV events are all real.

The model (34M parameters, 16 KiB of KV per token in bfloat16, 32 KiB in float32) is
sized so that a long prompt's prefill dominates a request's time on one CPU core (seconds
for a few thousand tokens) while a cached prompt costs tens of milliseconds: that is what makes cache-aware routing
measurable on a CPU.

Usage: python build_model.py OUT_DIR   (prints OUT_DIR; reuses it when already complete)
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

VOCAB_SIZE = 4096
SPECIAL_TOKENS = [
    "<s>",
    "</s>",
    "<pad>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

# Hermes/Qwen-style template: tools as `tojson` lines inside the system turn, tool calls as
# JSON inside <tool_call> tags, tool results as user-side <tool_response> blocks. Its
# `tojson` of the tools and of the call arguments is exactly where unnormalised clients'
# key order would leak into tokens.
CHAT_TEMPLATE = """{{- bos_token }}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}
{{- messages[0].content + '\\n\\n' }}
{%- endif %}
{{- 'You may call one or more functions. Function signatures:\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' + (tool | tojson) }}
{%- endfor %}
{{- '\\n</tools>\\nReturn each call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'user' or message.role == 'system' %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.content %}{{- message.content }}{%- endif %}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- set fn = tool_call.function if tool_call.function is defined else tool_call %}
{{- '\\n<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' + (fn.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}


def corpus_files() -> list[str]:
    """Training text: the interpreter's own standard library, sorted for determinism."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(str(p) for p in stdlib.glob("*.py"))


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(corpus_files(), trainer)
    # Completions get a BOS like Llama's tokenizers do; chat templates write it themselves
    # and are tokenized without special tokens.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": LLAMA_CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, indent=2)
    )


def _recipe() -> str:
    """Identifies what build() makes: a cached model dir is rebuilt when this changes."""
    import hashlib

    blob = json.dumps([LLAMA_CONFIG, CHAT_TEMPLATE, SPECIAL_TOKENS, VOCAB_SIZE, sys.version_info[:2]])
    return hashlib.sha256(blob.encode()).hexdigest()


def build(out: Path) -> Path:
    done = out / ".complete"
    if done.exists() and done.read_text().strip() == _recipe():
        return out
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    (out / "config.json").write_text(json.dumps(LLAMA_CONFIG, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}, indent=2)
    )
    done.write_text(_recipe() + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    print(build(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
