"""Screenshots for agent workloads: PNG data URLs of a given size, as computer-use and
browser agents send them (the OpenAI and Anthropic SDKs inline a local image as base64).

The bytes after the PNG header are pseudo-random (seeded), so equal seeds give the same
image and a different seed a different one; nothing decodes pixels (neither the router nor
the simulator), so only the header's size and the payload's bytes matter.
"""

from __future__ import annotations

import base64
import random
import struct
import zlib
from dataclasses import dataclass
from typing import Any

SCREEN_SIZES = ((1280, 800), (1440, 900), (1536, 864), (1920, 1080))
"""Common desktop resolutions, from 1280×800 to 1920×1080."""


def png_bytes(width: int, height: int, size: int, seed: int) -> bytes:
    """A `size`-byte PNG whose header says width × height (its payload seeded)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    head = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    body = random.Random(seed).randbytes(max(size - len(head), 0))
    return head + body


def png_data_url(width: int, height: int, size: int = 300_000, seed: int = 0) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(width, height, size, seed)).decode()


def screenshot_part(width: int, height: int, size: int = 300_000, seed: int = 0) -> dict:
    """A chat content part carrying one screenshot."""
    return {"type": "image_url", "image_url": {"url": png_data_url(width, height, size, seed)}}


@dataclass(frozen=True, slots=True)
class Screenshot:
    """One screenshot of a workload, by its description: a session holds these, not the
    megabytes of their data URLs, which are built only while the session runs."""

    width: int
    height: int
    size: int
    """Bytes of the PNG (its base64 text is 4/3 as long)."""
    seed: int

    def part(self) -> dict[str, Any]:
        """Its chat content part (builds the PNG and its data URL: about 2.5 ms for 300 KB)."""
        return screenshot_part(self.width, self.height, self.size, self.seed)
