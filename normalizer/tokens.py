"""The deterministic token estimate shared by the router and the simulated workers.

Real tokenizers average close to four bytes a token on English text and JSON. The router
uses this estimate when it has no tokenizer of the model (precise mode brings one); the
simulator tokenizes with exactly the same rule, so that predicted cache hits can be
checked against what the simulated engine really reused.
"""

CHARS_PER_TOKEN = 4


def estimate_tokens(data: bytes | str) -> int:
    """Whole tokens contained in `data` (UTF-8 bytes; a str is measured in UTF-8)."""
    if isinstance(data, str):
        data = data.encode()
    return len(data) // CHARS_PER_TOKEN
