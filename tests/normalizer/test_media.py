"""Media in prompts: one chain element each, keyed by content, counted by the model's rule."""

from __future__ import annotations

import base64
import struct

import pytest

from normalizer.anthropic import as_chat as anthropic_chat
from normalizer.media import (
    Media,
    MediaReader,
    MediaSettings,
    image_size,
    pixtral,
    qwen2_vl,
    rule_for_model,
)
from normalizer.prefix import chat_prompt, prefix_chain, segment_blocks
from normalizer.responses import as_chat as responses_chat

QWEN = "Qwen/Qwen2.5-VL-7B-Instruct"


def png(width: int, height: int, body: int = 0, seed: int = 0) -> bytes:
    header = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + struct.pack(">II", width, height) + b"\x08\x02\x00\x00\x00"
    return header + bytes([seed % 256]) * body


def jpeg(width: int, height: int) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00" + b"\x00" * 9
    exif = b"\xff\xe1" + struct.pack(">H", 2 + 3000) + b"x" * 3000  # metadata before the frame
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, height, width, 3) + b"\x00" * 9
    return b"\xff\xd8" + app0 + exif + sof + b"\xff\xda" + b"\x00" * 100


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_image_sizes_come_from_their_headers() -> None:
    assert image_size(png(1920, 1080, 100)) == (1920, 1080)
    assert image_size(b"GIF89a" + struct.pack("<HH", 640, 480) + b"\x00" * 10) == (640, 480)
    assert image_size(jpeg(1280, 800)) == (1280, 800)
    vp8x = b"RIFF\x00\x00\x00\x00WEBPVP8X" + b"\x0a\x00\x00\x00" + b"\x00" * 4 + (1919).to_bytes(3, "little") + (1079).to_bytes(3, "little")
    assert image_size(vp8x) == (1920, 1080)
    vp8 = b"RIFF\x00\x00\x00\x00WEBPVP8 " + b"\x00" * 7 + b"\x9d\x01\x2a" + struct.pack("<HH", 800, 600)
    assert image_size(vp8) == (800, 600)
    bits = (1023) | (767 << 14)
    vp8l = b"RIFF\x00\x00\x00\x00WEBPVP8L" + b"\x00" * 4 + b"\x2f" + bits.to_bytes(4, "little")
    assert image_size(vp8l) == (1024, 768)


@pytest.mark.parametrize(
    "data",
    [b"", b"not an image at all", png(0, 100), png(1 << 20, 10), b"\xff\xd8\xff\xda" + b"\x00" * 20, png(100, 100)[:20]],
)
def test_an_unreadable_or_lying_header_gives_no_size(data: bytes) -> None:
    assert image_size(data) is None


def test_the_qwen2_vl_rule_counts_28_pixel_tiles_within_its_bounds() -> None:
    assert qwen2_vl(1920, 1080) == 39 * 69 + 2  # 1092 × 1932 after rounding to 28
    assert qwen2_vl(1280, 800) == round(800 / 28) * round(1280 / 28) + 2
    assert qwen2_vl(10, 10) == 2 * 2 + 2  # raised to min_pixels (56 × 56)
    assert qwen2_vl(20_000, 20_000) <= 12_845_056 // (28 * 28) + 2  # held under max_pixels
    assert pixtral(1920, 1080) == 36 * (64 + 1)  # scaled to 1024 × 576, 16-pixel patches, a break per row


def test_the_rule_follows_the_models_name_where_it_is_unambiguous() -> None:
    assert rule_for_model(QWEN) == rule_for_model("qwen2-vl-2b") == rule_for_model("bytedance/UI-TARS-7B") == "qwen2_vl"
    assert rule_for_model("llava-hf/llava-1.5-7b-hf") == "llava"
    assert rule_for_model("google/gemma-3-4b-it") == "gemma3"
    assert rule_for_model("mistralai/Pixtral-12B-2409") == "pixtral"
    assert rule_for_model("meta-llama/Llama-3.1-8B-Instruct") is None
    with pytest.raises(ValueError):
        MediaSettings(image_rule="wrong")
    assert MediaReader(MediaSettings(image_rule="fixed:99")).media(image_part(data_url(png(5, 5))), "x") == Media(
        "image", MediaReader().media(image_part(data_url(png(5, 5))), "x").digest, 99  # type: ignore[union-attr]
    )


def test_an_image_is_keyed_by_its_content_and_counted_by_its_size() -> None:
    reader = MediaReader()
    shot = data_url(png(1920, 1080, 300_000, seed=1))
    a = reader.media(image_part(shot), QWEN)
    assert a is not None and a.tokens == qwen2_vl(1920, 1080) and a.kind == "image"
    assert reader.media(image_part(shot), QWEN) == a  # the same bytes, the same key
    assert reader.media(image_part(data_url(png(1920, 1080, 300_000, seed=2))), QWEN).digest != a.digest  # type: ignore[union-attr]
    # A model with no known rule: the stated default per image.
    assert reader.media(image_part(shot), "some-text-model").tokens == MediaSettings().image_tokens_default  # type: ignore[union-attr]
    # The placeholder stands for its tokens at four bytes each.
    assert len(a.placeholder()) == 4 * a.tokens


@pytest.mark.parametrize(
    "url",
    [
        "https://example.com/screenshot.png",  # remote: named by its URL, size unknown
        "data:image/png;base64,iVBORw0KGgoAAAANSUhE",  # truncated inside its header
        "data:image/png;base64,@@@ not base64 @@@",
        "data:image/png,rawbytesnotbase64",
        "data:application/pdf;base64," + base64.b64encode(b"%PDF-1.7 " * 50).decode(),  # unknown media type
        data_url(png(70_000, 70_000, 10)),  # a header that lies about its size
        "",
    ],
)
def test_bad_media_still_makes_one_element_with_the_default_count(url: str) -> None:
    element = MediaReader().media(image_part(url), QWEN)
    assert element is not None and element.tokens == MediaSettings().image_tokens_default


def test_an_image_truncated_after_its_header_is_counted_by_the_header() -> None:
    # The engine will refuse it; the router prices what the header says and forwards it.
    element = MediaReader().media(image_part("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAB4AAAAQ4"), QWEN)
    assert element is not None and element.tokens == qwen2_vl(1920, 1080)


def test_a_part_whose_type_is_not_a_string_is_no_media() -> None:
    weird = {"type": {}, "text": "", "image_url": {"url": ""}}
    assert MediaReader().media(weird, QWEN) is None
    segments, _ = chat_prompt({"model": QWEN, "messages": [{"role": "user", "content": [weird, {"type": ["x"]}]}]}, MediaReader())
    assert len(segments) == 2 and all(isinstance(s, bytes) for s in segments)


def test_audio_and_video_parts_count_their_estimates() -> None:
    settings = MediaSettings(audio_tokens=300, video_tokens=2000)
    reader = MediaReader(settings)
    audio = reader.media({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}, QWEN)
    video = reader.media({"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}, QWEN)
    assert (audio.kind, audio.tokens, video.kind, video.tokens) == ("audio", 300, "video", 2000)  # type: ignore[union-attr]
    assert reader.media({"type": "text", "text": "hi"}, QWEN) is None


def screenshots_conversation(turns: int, size: int = 300_000) -> dict:
    messages: list[dict] = [{"role": "system", "content": "You operate a browser. " * 20}]
    for t in range(turns):
        messages.append({"role": "user", "content": [
            {"type": "text", "text": f"Step {t}: here is the screen."},
            image_part(data_url(png(1920, 1080, size, seed=t))),
        ]})  # fmt: skip
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f"I click on element {t}."})
    return {"model": QWEN, "messages": messages}


def chain_of(body: dict):
    blocks, reply = segment_blocks(*chat_prompt(body, MediaReader()))
    return prefix_chain(body["model"], blocks, reply or None)


def test_twenty_screenshots_make_twenty_elements_and_their_model_tokens() -> None:
    body = screenshots_conversation(20)
    chain = chain_of(body)
    text_only = chain_of({**body, "messages": [
        {**m, "content": [p for p in m["content"] if p["type"] == "text"]} if isinstance(m["content"], list) else m
        for m in body["messages"]
    ]})  # fmt: skip
    # One key per image beside the text's keys (each user message's text splits around it).
    assert len(chain.keys) <= len(text_only.keys) + 2 * 20
    assert chain.total_tokens == pytest.approx(text_only.total_tokens + 20 * qwen2_vl(1920, 1080), abs=100)
    assert chain.total_tokens < 70_000  # not 2M: the base64 text is not counted as text
    # Turn 20 extends turn 19: its whole chain is a prefix, the reply found.
    previous = chain_of(screenshots_conversation(19))
    assert chain.keys[: len(previous.keys)] == previous.keys and chain.reply_depth > 0


def test_the_agent_apis_key_an_image_as_chat_does() -> None:
    png_bytes = png(1280, 800, 5000)
    url = data_url(png_bytes)
    chat = chain_of({"model": QWEN, "messages": [{"role": "user", "content": [image_part(url)]}]})
    responses = responses_chat({"model": QWEN, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": url}]}
    ]})  # fmt: skip
    anthropic = anthropic_chat({"model": QWEN, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png_bytes).decode()}}
    ]}]})  # fmt: skip
    for body in (responses, anthropic):
        other = chain_of(body)
        blocks, _ = segment_blocks(*chat_prompt(body, MediaReader()))
        images = [b for b in blocks if isinstance(b, Media)]
        assert len(images) == 1 and images[0].tokens == qwen2_vl(1280, 800)
        assert other.total_tokens == pytest.approx(chat.total_tokens, abs=20)
