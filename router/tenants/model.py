"""A tenant as the router sees it: pure data, no I/O.

A request's tenant comes from its client key (`Authorization: Bearer KEY` or `x-api-key`);
`TenantTable.for_key` finds it with one SHA-256 of the presented key and one dict lookup,
as `router.auth.KeyCheck` does, so the lookup's timing never depends on how much of a real
key a client guessed. Without a tenants file there is no table and behaviour is as before.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from router.auth import key_digest

PRIVATE_SCOPE = "private"
"""The default cache scope: the tenant's prompts share KV blocks with no other tenant's."""


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """Per-tenant limits; None means unlimited."""

    requests_per_s: float | None = None
    tokens_per_min: int | None = None
    """Prompt and generated tokens per minute."""
    concurrent: int | None = None
    """Requests in flight at once."""


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    keys: tuple[str, ...] = ()
    cache_scope: str = PRIVATE_SCOPE
    """`private`, or the name of a sharing group whose tenants share cached prefixes."""
    weight: float = 1.0
    """Share of the fleet in the fair-share admission queue, relative to other tenants."""
    limits: TenantLimits = field(default_factory=TenantLimits)

    @property
    def scope_id(self) -> str:
        """The cache scope's identity: the tenant's own name when private, else the group's.
        Salts and index seeds derive from this, never from a client-supplied value."""
        return f"tenant:{self.name}" if self.cache_scope == PRIVATE_SCOPE else f"group:{self.cache_scope}"


class TenantTable:
    """Tenants by client key. Immutable once built: a reload builds a new table and swaps it."""

    def __init__(self, tenants: Iterable[Tenant]) -> None:
        self.tenants: Mapping[str, Tenant] = {t.name: t for t in tenants}
        self._by_digest: dict[bytes, tuple[bytes, Tenant]] = {}
        for tenant in self.tenants.values():
            for key in tenant.keys:
                digest = key_digest(key.encode())
                if digest in self._by_digest:
                    raise ValueError(f"key given to two tenants: {self._by_digest[digest][1].name}, {tenant.name}")
                self._by_digest[digest] = (digest, tenant)

    def __len__(self) -> int:
        return len(self.tenants)

    def for_key(self, key: bytes | None) -> Tenant | None:
        """The tenant owning this client key, or None (unknown key, or none presented)."""
        if not key:
            return None
        digest = key_digest(key)
        found = self._by_digest.get(digest)
        if found is None or not hmac.compare_digest(found[0], digest):
            return None
        return found[1]
