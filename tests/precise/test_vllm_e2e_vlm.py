"""The real-vLLM stage's phase `vlm` on its own parts, no vLLM needed: the PNGs it sends, the
tiny Qwen2-VL it serves (config and chat template), the router's counts of its requests,
and its verdict on made-up rows."""

from __future__ import annotations

import itertools
import struct
import zlib
from typing import Any

import pytest

from loadtests.e2e.vllm.build_vlm import (
    CHAT_TEMPLATE,
    HEAD_DIM,
    PREPROCESSOR_CONFIG,
    QWEN2_VL_CONFIG,
    TOKEN_ID,
)
from loadtests.e2e.vllm.run_e2e import (
    CHECKS,
    VLM_IMAGES,
    VLM_LIMIT_MM,
    ImageConversation,
    parse_args,
    png,
    vlm_verdict,
)
from normalizer.media import MediaReader, MediaSettings, image_size, qwen2_vl
from normalizer.prefix import chat_prompt, prefix_chain


def _chunks(data: bytes) -> dict[bytes, bytes]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    out, at = {}, 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length : at + 12 + length])
        assert crc == zlib.crc32(kind + body), kind
        out[kind] = body
        at += 12 + length
    return out


def test_the_images_are_real_pngs_of_their_size_and_differ_by_seed() -> None:
    data = png(64, 40, seed=3)
    chunks = _chunks(data)
    assert set(chunks) == {b"IHDR", b"IDAT", b"IEND"}
    assert struct.unpack(">IIBBBBB", chunks[b"IHDR"]) == (64, 40, 8, 2, 0, 0, 0)
    rows = zlib.decompress(chunks[b"IDAT"])
    # Every row: filter byte 0, then width × RGB.
    assert len(rows) == 40 * (1 + 64 * 3) and all(rows[y * (1 + 192)] == 0 for y in range(40))
    assert image_size(data) == (64, 40)
    assert png(64, 40, seed=4) != data and png(64, 40, seed=3) == data
    assert len(png(1920, 1080, seed=1)) < 100_000  # small enough to resend every turn


def test_the_image_sizes_cover_the_qwen2_vl_rule_and_fit_the_profiling_size() -> None:
    counts = {size: qwen2_vl(*size) for sizes in VLM_IMAGES for size in sizes}
    assert counts == {(640, 480): 393, (1280, 800): 1336, (1920, 1080): 2693, (800, 600): 611}
    assert all(len(sizes) <= VLM_LIMIT_MM["image"]["count"] for sizes in VLM_IMAGES)
    biggest = max((s for sizes in VLM_IMAGES for s in sizes), key=lambda s: s[0] * s[1])
    assert biggest == (VLM_LIMIT_MM["image"]["width"], VLM_LIMIT_MM["image"]["height"])


def test_the_tiny_qwen2_vl_is_consistent() -> None:
    c, v = QWEN2_VL_CONFIG, QWEN2_VL_CONFIG["vision_config"]
    assert c["hidden_size"] == c["num_attention_heads"] * HEAD_DIM
    # M-RoPE's (time, height, width) sections share the head's rotary frequency pairs.
    assert sum(c["rope_scaling"]["mrope_section"]) == HEAD_DIM // 2
    assert v["hidden_size"] == c["hidden_size"]  # the merger's output feeds the language model
    assert (v["patch_size"], v["spatial_merge_size"], v["temporal_patch_size"]) == (14, 2, 2)
    assert (PREPROCESSOR_CONFIG["patch_size"], PREPROCESSOR_CONFIG["merge_size"]) == (14, 2)
    assert (PREPROCESSOR_CONFIG["min_pixels"], PREPROCESSOR_CONFIG["max_pixels"]) == (3136, 12_845_056)
    ids = {k: c[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    assert ids == {"image_token_id": TOKEN_ID["<|image_pad|>"], "video_token_id": TOKEN_ID["<|video_pad|>"],
                   "vision_start_token_id": TOKEN_ID["<|vision_start|>"],
                   "vision_end_token_id": TOKEN_ID["<|vision_end|>"]}


def test_the_template_renders_each_image_as_qwen2_vl_does() -> None:
    jinja2 = pytest.importorskip("jinja2")
    conv = ImageConversation(0)
    conv.request((640, 480))
    conv.reply()
    body = conv.request((1280, 800))
    # vLLM hands the template its image parts as {"type": "image"}.
    messages = [
        {**m, "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]}
        if isinstance(m["content"], list) else m
        for m in body["messages"]
    ]
    text = jinja2.Environment().from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou compare pictures for album 0.<|im_end|>\n"
        "<|im_start|>user\nPicture 1: what changed?<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
        "<|im_start|>assistant\nThe colours of picture 1.<|im_end|>\n"
        "<|im_start|>user\nPicture 2: what changed?<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_the_router_counts_each_image_by_its_size_and_the_history_as_the_next_turns_prefix() -> None:
    reader = MediaReader(MediaSettings(image_rule="qwen2_vl"))
    conv = ImageConversation(1)
    chains = []
    for size in VLM_IMAGES[1]:
        body = conv.request(size)
        segments, reply_at = chat_prompt(body, reader)
        media = [s for s in segments if not isinstance(s, bytes)]
        assert [m.tokens for m in media][-1] == qwen2_vl(*size)
        chains.append(prefix_chain(body["model"], segments, reply_at))
        conv.reply()
    for before, after in itertools.pairwise(chains):
        assert after.keys[: len(before.keys)] == before.keys
    # Images are most of every prompt: the text's estimate matters little.
    assert all(sum(qwen2_vl(*s) for s in VLM_IMAGES[1][: i + 1]) > 0.9 * c.total_tokens for i, c in enumerate(chains))


def _vlm_row(router: int, engine: int, predicted: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens_router": router, "prompt_tokens_vllm": engine, "predicted_cached": predicted,
            "cached_tokens_vllm": cached}


def test_vlm_passes_within_ten_percent_and_fails_outside() -> None:
    rows = [_vlm_row(422, 430, 0, 0), _vlm_row(1786, 1799, 422, 416), _vlm_row(4508, 4525, 1786, 1792)]
    verdict = vlm_verdict(rows)
    assert verdict["ok"] and verdict["prompt_within"] == 3 and verdict["cached_tokens_vllm_total"] == 2208
    # One request counted as text (its image's base64 at four bytes a token): far off.
    bad = vlm_verdict([*rows[:2], _vlm_row(60_000, 4525, 1786, 1792)])
    assert not bad["prompt_ok"] and bad["cached_ok"] and not bad["ok"]
    # Cached tokens: within 10% in all, not per request; a run that reused nothing fails.
    assert not vlm_verdict([_vlm_row(422, 430, 0, 0), _vlm_row(1786, 1799, 1700, 416)])["cached_ok"]
    assert not vlm_verdict([_vlm_row(422, 430, 0, 0)])["ok"]
    assert not vlm_verdict([])["ok"]
    assert "vlm" in CHECKS


def test_vlm_options() -> None:
    args = parse_args(["--venv", "/v", "--model", "m", "--vlm-model", "/x/tiny-qwen2-vl", "--only-vlm"])
    assert args.only_vlm and str(args.vlm_site) == "/v/vlm-site" and str(args.vlm_model) == "/x/tiny-qwen2-vl"
    assert parse_args(["--venv", "v", "--model", "m", "--skip-vlm"]).skip_vlm
    with pytest.raises(SystemExit):
        parse_args(["--venv", "v", "--model", "m", "--skip-vlm", "--only-vlm"])
