"""Build the tiny vision-language test model: a Qwen2-VL config (dummy weights), a local BPE
tokenizer with Qwen2-VL's special tokens and chat template, and Qwen2-VL's image processor
settings.

As for the text model (build_model.py), there is no model hub here: the tokenizer is trained
with `tokenizers` on the Python standard library's source, and vLLM runs the model with
`--load-format dummy`, so no weights are written. What the real-vLLM stage checks with it is
the prompt's length and what the engine's prefix cache reuses, which are exact whatever the
weights: an image is as many <|image_pad|> tokens as Qwen2-VL's processor makes of its size
(the HF `smart_resize` to multiples of 28 pixels within min_pixels / max_pixels, one token
per 28×28 tile), between <|vision_start|> and <|vision_end|>.

Sizes: a 4-layer, 256-wide language model (64-dimensional heads, so M-RoPE's sections
are 8/12/12) and a one-block, 64-wide vision tower with Qwen2-VL's geometry (14-pixel
patches, 2 frames a patch, 2×2 merge). A 1920×1080 image is 2,693 prompt tokens and 10,764
patches; on this 2-core machine a first turn with one (2,730 tokens, the image encoded)
takes 0.4-0.7 s, and a follow-up turn adding a 1280×800 image to 3,360 cached tokens 0.3-0.5 s.

The processor settings are Qwen2-VL-7B-Instruct's (min_pixels 3,136, max_pixels 12,845,056),
which is the rule the router's `--image-rule qwen2_vl` follows. vLLM decodes each image with
Pillow and hands it to transformers' Qwen2VLProcessor, whose Qwen2VLImageProcessor resizes,
normalizes and cuts it into patches with plain torch ops (its torchvision backend: the
torchvision of setup_env.sh's VLM_SITE, whose own C++ ops never load).

Usage: python build_vlm.py OUT_DIR   (prints OUT_DIR; reuses it when already complete)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

try:
    from loadtests.e2e.vllm.build_model import corpus_files
except ImportError:  # run as a script (setup_env.sh): its folder is first on sys.path
    from build_model import corpus_files  # type: ignore[no-redef]

VOCAB_SIZE = 4096
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
"""Qwen2-VL's special tokens, first in the vocabulary so that their ids are fixed."""
TOKEN_ID = {token: i for i, token in enumerate(SPECIAL_TOKENS)}

# Qwen2-VL-7B-Instruct's template: each image part is `<|vision_start|><|image_pad|><|vision_end|>`,
# whose one <|image_pad|> vLLM's processor expands to the image's token count.
CHAT_TEMPLATE = """{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}\
{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}<|im_start|>{{ message['role'] }}
{% if message['content'] is string %}{{ message['content'] }}<|im_end|>
{% else %}{% for content in message['content'] %}\
{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}\
{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}\
<|vision_start|><|image_pad|><|vision_end|>\
{% elif content['type'] == 'video' or 'video' in content %}\
{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}\
<|vision_start|><|video_pad|><|vision_end|>\
{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

HEAD_DIM = 64
QWEN2_VL_CONFIG = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "model_type": "qwen2_vl",
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    # M-RoPE: the head's 32 rotary frequency pairs split over (time, height, width).
    "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
    "use_sliding_window": False,
    "sliding_window": 16384,
    "max_window_layers": 4,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": TOKEN_ID["<|endoftext|>"],
    "eos_token_id": TOKEN_ID["<|im_end|>"],
    "vision_start_token_id": TOKEN_ID["<|vision_start|>"],
    "vision_end_token_id": TOKEN_ID["<|vision_end|>"],
    "vision_token_id": TOKEN_ID["<|vision_pad|>"],
    "image_token_id": TOKEN_ID["<|image_pad|>"],
    "video_token_id": TOKEN_ID["<|video_pad|>"],
    "vision_config": {
        "depth": 1,
        "embed_dim": 64,
        "mlp_ratio": 2,
        "num_heads": 2,
        "in_channels": 3,
        "hidden_size": 256,
        "hidden_act": "quick_gelu",
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
}

MIN_PIXELS = 56 * 56
MAX_PIXELS = 12_845_056
PREPROCESSOR_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "do_convert_rgb": True,
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "resample": 3,
    "min_pixels": MIN_PIXELS,
    "max_pixels": MAX_PIXELS,
    "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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
    for token, want in TOKEN_ID.items():
        assert tok.token_to_id(token) == want, (token, tok.token_to_id(token))
    # No BOS, like Qwen2's tokenizer: the template writes every special token itself.
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": QWEN2_VL_CONFIG["max_position_embeddings"],
        "errors": "replace",
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": True}
            for t, i in TOKEN_ID.items()
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2)
    )


def _recipe() -> str:
    """Identifies what build() makes: a cached model dir is rebuilt when this changes."""
    blob = json.dumps(
        [QWEN2_VL_CONFIG, PREPROCESSOR_CONFIG, CHAT_TEMPLATE, SPECIAL_TOKENS, VOCAB_SIZE, sys.version_info[:2]]
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def build(out: Path) -> Path:
    done = out / ".complete"
    if done.exists() and done.read_text().strip() == _recipe():
        return out
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    (out / "config.json").write_text(json.dumps(QWEN2_VL_CONFIG, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2))
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": TOKEN_ID["<|endoftext|>"],
        "eos_token_id": [TOKEN_ID["<|im_end|>"], TOKEN_ID["<|endoftext|>"]],
        "pad_token_id": TOKEN_ID["<|endoftext|>"],
    }, indent=2))
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
