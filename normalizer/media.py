"""Images, audio and video in prompts: one chain element each, keyed by content and counted
the way the served model counts it.

A vision-language model sees an image as a run of placeholder tokens whose length depends
on the image's size and the model's processor, not on the bytes of its encoding: a 300 KB
PNG screenshot is about 2,700 tokens to Qwen2.5-VL and 576 to LLaVA-1.5, where counting its
base64 text as text would give 100,000. So each media part of a message becomes one
`Media` element of the prompt: a key from a digest of its content and a token count.

* Key. For a data URL, a digest of its base64 payload (the same image sent again is the
  same text: SDKs encode without line breaks, and the standard alphabet and padding make
  the text a function of the bytes), taken with xxHash's XXH3-128 (25 GB/s; decoding the
  base64 first would cost more than the whole digest). For a remote image, of its URL.
* Count. The image's width and height come from its header (PNG, JPEG, GIF, WebP), read
  from the first decoded bytes without decoding pixels; the model family's rule turns
  them into tokens (`IMAGE_RULES`, chosen by `MediaSettings.image_rule`, by default from
  the model's name). An image whose size cannot be read (a remote URL, a truncated or
  unknown payload, a header claiming an impossible size) counts `image_tokens_default`.
  Audio and video parts count a configured estimate each.

Nothing here rejects a request: a malformed part is still an element with the default
count, and the engine answers for it as it would without a router in front.
"""

from __future__ import annotations

import binascii
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import xxhash

from normalizer.tokens import CHARS_PER_TOKEN


class Media(NamedTuple):
    """One image, audio clip or video in a prompt."""

    kind: str
    """"image", "audio" or "video"."""
    digest: bytes
    """16 bytes naming its content (`media_digest`)."""
    tokens: int
    """Prompt tokens the model spends on it (placeholders and their delimiters)."""

    def placeholder(self) -> bytes:
        """Stand-in bytes of its token count (`CHARS_PER_TOKEN` a token), derived from its
        digest: where a prompt is handled as bytes (the simulated engine), the same media
        is the same bytes and counts its own tokens, as an engine's placeholder tokens do."""
        size = self.tokens * CHARS_PER_TOKEN
        return (self.digest * (size // len(self.digest) + 1))[:size]


MAX_SIDE = 1 << 16
"""Sides beyond this (no real image) are a header that lies: its size is not read."""


# -- image headers ---------------------------------------------------------------------------
def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the header of a PNG, GIF, WebP or JPEG image, or None."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24 and data[12:16] == b"IHDR":
        w, h = struct.unpack(">II", data[16:24])
    elif data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        w, h = struct.unpack("<HH", data[6:10])
    elif data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        size = _webp_size(data)
        if size is None:
            return None
        w, h = size
    elif data[:2] == b"\xff\xd8":
        size = _jpeg_size(data)
        if size is None:
            return None
        w, h = size
    else:
        return None
    if not (0 < w <= MAX_SIDE and 0 < h <= MAX_SIDE):
        return None
    return w, h


def _webp_size(data: bytes) -> tuple[int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8X" and len(data) >= 30:
        return 1 + int.from_bytes(data[24:27], "little"), 1 + int.from_bytes(data[27:30], "little")
    if chunk == b"VP8 " and len(data) >= 30 and data[23:26] == b"\x9d\x01\x2a":
        w, h = struct.unpack("<HH", data[26:30])
        return w & 0x3FFF, h & 0x3FFF
    if chunk == b"VP8L" and len(data) >= 25 and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
"""JPEG start-of-frame markers (not DHT 0xC4, JPG 0xC8, DAC 0xCC)."""


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    at, end = 2, len(data)
    while at + 4 <= end:
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # no length
            at += 2
            continue
        (length,) = struct.unpack(">H", data[at + 2 : at + 4])
        if marker in _SOF:
            if at + 9 > end:
                return None
            h, w = struct.unpack(">HH", data[at + 5 : at + 9])
            return w, h
        if marker == 0xDA or length < 2:  # scan data before any frame header: malformed
            return None
        at += 2 + length
    return None


# -- the models' rules -----------------------------------------------------------------------
ImageRule = Callable[[int, int], int]
"""(width, height) -> the image's prompt tokens."""


def qwen2_vl(width: int, height: int, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 12_845_056) -> int:
    """Qwen2-VL and Qwen2.5-VL (vLLM's `Qwen2VLProcessingInfo`, the HF `smart_resize`): the
    image is resized to multiples of 28 pixels (14-pixel patches merged 2×2) within
    min/max pixels, one token per 28×28 tile, between <|vision_start|> and <|vision_end|>."""
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return (h // factor) * (w // factor) + 2


def pixtral(width: int, height: int, patch: int = 16, longest: int = 1024) -> int:
    """Pixtral and Mistral Small 3.x (vLLM's `PixtralProcessingInfo`, mistral-common): the
    image is scaled down to fit `longest` pixels on its longer side, cut in 16-pixel
    patches, one token each, with an [IMG_BREAK] after every row ([IMG_END] after the last)."""
    ratio = max(width / longest, height / longest)
    if ratio > 1:
        width, height = math.floor(width / ratio), math.floor(height / ratio)
    rows, cols = math.ceil(height / patch), math.ceil(width / patch)
    return rows * (cols + 1)


def fixed(tokens: int) -> ImageRule:
    """Models that resize every image to one size: the same count whatever the image."""
    return lambda width, height: tokens


IMAGE_RULES: dict[str, ImageRule] = {
    "qwen2_vl": qwen2_vl,
    "pixtral": pixtral,
    "llava": fixed(576),  # LLaVA-1.5: 336×336, 14-pixel patches
    "gemma3": fixed(260),  # 256 soft tokens, <start_of_image>, <end_of_image> and their blank lines
}
"""Image rules by name (`--image-rule`; `fixed:N` for any other model of constant count)."""

_BY_NAME = (
    (re.compile(r"qwen2(\.5)?[-_]?vl|ui-tars|qwen2_5_vl", re.I), "qwen2_vl"),
    (re.compile(r"pixtral|mistral-small-3", re.I), "pixtral"),
    (re.compile(r"llava-(v)?1\.5|llava-1\.5", re.I), "llava"),
    (re.compile(r"gemma-?3", re.I), "gemma3"),
)
"""Model names whose family is unambiguous: `image_rule: auto` picks their rule."""


def rule_named(name: str) -> ImageRule:
    if name.startswith("fixed:"):
        count = int(name.removeprefix("fixed:"))
        if count <= 0:
            raise ValueError(f"fixed:N needs N > 0, not {count}")
        return fixed(count)
    if name not in IMAGE_RULES:
        raise ValueError(f"unknown image rule {name!r}; known: auto, {', '.join(IMAGE_RULES)}, fixed:N")
    return IMAGE_RULES[name]


def rule_for_model(model: str) -> str | None:
    """The rule a model's name says, or None if it says none unambiguously."""
    for pattern, rule in _BY_NAME:
        if pattern.search(model):
            return rule
    return None


# -- settings and the reader -----------------------------------------------------------------
@dataclass(frozen=True)
class MediaSettings:
    """The `media` section: how images, audio and video in prompts are counted."""

    image_rule: str = "auto"
    """auto (by the model's name, else `image_tokens_default` per image), a rule of
    `IMAGE_RULES`, or fixed:N."""
    image_tokens_default: int = 1024
    """Tokens of an image whose size cannot be read or whose model has no known rule: about
    a 1024×1024 image to Qwen2.5-VL (1,339) and a 768×768 one (756), the sizes agents send."""
    audio_tokens: int = 750
    """Tokens of one audio clip: 30 s at 25 tokens a second (Qwen2-Audio's encoder; Whisper's
    1,500 frames pooled 2×)."""
    video_tokens: int = 4096
    """Tokens of one video: vLLM's default frame sampling keeps a few thousand."""

    def __post_init__(self) -> None:
        if self.image_rule != "auto":
            rule_named(self.image_rule)
        for name in ("image_tokens_default", "audio_tokens", "video_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


class MediaReader:
    """Turns media parts into `Media` elements for one deployment's settings."""

    __slots__ = ("_by_model", "settings")

    def __init__(self, settings: MediaSettings | None = None) -> None:
        self.settings = settings or MediaSettings()
        self._by_model: dict[str, ImageRule | None] = {}

    def image_rule(self, model: str) -> ImageRule | None:
        rule = self._by_model.get(model, _UNSET)
        if rule is _UNSET:
            name = self.settings.image_rule
            if name == "auto":
                name = rule_for_model(model)
            rule = None if name is None else rule_named(name)
            if len(self._by_model) < 1024:  # model names come from clients: bounded
                self._by_model[model] = rule
        return rule  # type: ignore[return-value]

    def media(self, part: dict[str, Any], model: str) -> Media | None:
        """The part's `Media` element, or None if it is not a media part."""
        kind = part.get("type")
        if not isinstance(kind, str):
            return None
        if kind in ("image_url", "input_image", "image"):
            return self._image(_url_of(part, kind), model)
        if kind in ("input_audio", "audio_url"):
            return Media("audio", _digest(_payload_of(part, kind)), self.settings.audio_tokens)
        if kind == "video_url":
            return Media("video", _digest(_payload_of(part, kind)), self.settings.video_tokens)
        return None

    def _image(self, url: str, model: str) -> Media:
        payload, header = _data_url(url)
        rule = self.image_rule(model)
        tokens = self.settings.image_tokens_default
        if header is not None and rule is not None:
            size = image_size(header)
            if size is not None:
                tokens = max(rule(*size), 1)
        return Media("image", _digest(payload), tokens)


_UNSET: Any = object()
HEADER_BYTES = 8192
"""Decoded bytes searched for an image's size: PNG, GIF and WebP give it in the first 30,
a JPEG after its metadata segments, which a longer EXIF block can push past this (its size
then counts as unread)."""
_HEADER_CHARS = HEADER_BYTES // 3 * 4


def _url_of(part: dict[str, Any], kind: str) -> str:
    value = part.get("image_url") if kind != "image" else part.get("source") or part.get("image")
    if isinstance(value, dict):
        value = value.get("url") or value.get("data")
    return value if isinstance(value, str) else ""


def _payload_of(part: dict[str, Any], kind: str) -> str:
    value = part.get(kind)
    if isinstance(value, dict):
        value = value.get("url") or value.get("data")
    return value if isinstance(value, str) else ""


def _data_url(url: str) -> tuple[bytes | memoryview, bytes | None]:
    """(what names the image, its first decoded bytes or None). A data URL is named by its
    base64 payload; any other URL by itself."""
    raw = url.encode(errors="surrogatepass")
    if not url.startswith("data:"):
        return raw, None
    comma = raw.find(b",")
    if comma < 0 or not raw[5:comma].endswith(b";base64"):
        return raw, None
    head = raw[comma + 1 : comma + 1 + _HEADER_CHARS]
    payload = memoryview(raw)[comma + 1 :]
    try:
        return payload, binascii.a2b_base64(head[: len(head) // 4 * 4])
    except (binascii.Error, ValueError):
        return payload, None


def _digest(data: str | bytes | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(data.encode(errors="surrogatepass") if isinstance(data, str) else data)
