"""Client API keys for `/v1/*` and the admin token for `/admin/*` and `/debug/*`.

Keys come from `--api-keys K1,K2` (or `KVROUTE_API_KEYS`, or YAML `api_keys: [...]`) and
from `--api-keys-file PATH` (one key a line, `#` comments); the admin token from
`--admin-token-file PATH` or `KVROUTE_ADMIN_TOKEN` (a flag would show it in `ps`).

The check is on the hot path, so it is one SHA-256 of the presented key and one dict
lookup; the stored digest is then compared with `hmac.compare_digest`. Comparing digests
rather than keys means the lookup's timing depends only on a hash of what the client sent,
never on how much of a real key it guessed.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field

from router.errors import RouterError


@dataclass(frozen=True)
class SecuritySettings:
    """The `security` section of the router's config (secrets files are read at startup)."""

    api_keys: list[str] = field(default_factory=list)
    """Client keys accepted on /v1/* (empty, and no file: no authentication)."""
    api_keys_file: str | None = None
    admin_token: str | None = None
    """Token for /admin/* and /debug/* (prefer KVROUTE_ADMIN_TOKEN or the file)."""
    admin_token_file: str | None = None

    def client_keys(self) -> KeyCheck | None:
        """The /v1/* check; None: no client authentication."""
        keys = resolve_api_keys(self.api_keys, self.api_keys_file)
        return KeyCheck(keys) if keys else None

    def admin_check(self) -> KeyCheck | None:
        """The /admin/* and /debug/* check; None: admin endpoints disabled (403)."""
        token = resolve_admin_token(self.admin_token, self.admin_token_file)
        return KeyCheck([token]) if token else None

_BEARER = b"bearer "


def key_digest(key: bytes) -> bytes:
    """The form a client key is stored and looked up in (API keys here, tenant keys in
    router/tenants/model.py): a fixed-length digest, so lookups compare no secret bytes."""
    return hashlib.sha256(key).digest()


def read_secret_lines(path: str) -> list[str]:
    """Non-empty, non-comment lines of a secrets file (OSError if unreadable)."""
    with open(path, encoding="utf-8") as fh:
        return [line.strip() for line in fh if line.strip() and not line.lstrip().startswith("#")]


def resolve_api_keys(keys: Iterable[str], keys_file: str | None) -> list[str]:
    out = [k.strip() for k in keys if k and k.strip()]
    if keys_file:
        out += read_secret_lines(keys_file)
    return out


def resolve_admin_token(token: str | None, token_file: str | None) -> str | None:
    if token_file:
        lines = read_secret_lines(token_file)
        if len(lines) != 1:
            raise ValueError("the admin token file must hold exactly one token")
        return lines[0]
    return token.strip() if token and token.strip() else None


def presented_key(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The key in `Authorization: Bearer KEY` (or `x-api-key: KEY`)."""
    for name, value in headers:
        if name == b"authorization":
            if value[:7].lower() == _BEARER:
                return value[7:].strip()
            return None
        if name == b"x-api-key":
            return value.strip()
    return None


class KeyCheck:
    """A set of accepted keys, stored as digests."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = {key_digest(k.encode()): key_digest(k.encode()) for k in keys}
        if not self._digests:
            raise ValueError("no keys given")

    def __len__(self) -> int:
        return len(self._digests)

    def accepts(self, key: bytes | None) -> bool:
        if not key:
            return False
        digest = key_digest(key)
        stored = self._digests.get(digest)
        return stored is not None and hmac.compare_digest(stored, digest)

    def accepts_headers(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        return self.accepts(presented_key(headers))


def unauthorized(admin: bool = False) -> RouterError:
    what = "admin token" if admin else "API key"
    return RouterError(
        401,
        f"Invalid or missing {what}. Send it as 'Authorization: Bearer <{what.replace(' ', '-')}>'.",
        "invalid_api_key" if not admin else "invalid_admin_token",
    )
