"""Cache isolation between tenants: the `cache_salt` the router sets on every request.

A shared prefix cache leaks prompts through timing: a hit answers faster than a miss, and a
cache-aware router even steers a guess to the worker holding the victim's prompt. vLLM's
`cache_salt` request field closes this: the salt enters the hash of a prompt's first block,
so requests with different salts never share a block, and requests with the same salt share
as before.

With tenants configured the router sets `cache_salt` on every chat, completion, Responses and
Messages request it forwards, replacing any salt the client sent:

    salt = "kvr1-" + hex(HMAC-SHA256(secret, "kvroute cache salt\\0" + scope_id))

`scope_id` is `Tenant.scope_id` (`tenant:NAME` for a private scope, `group:NAME` for a
sharing group, `NO_TENANT_SCOPE` for requests that match no tenant), so tenants of one group
get one salt and every other pair of scopes gets two. The secret is the router's, never a
client's: a client can neither choose nor compute another scope's salt.

Where the secret comes from (`SaltSecret.resolve`), first found of:
1. `tenant_salt_secret_file` (one line) or `KVROUTE_TENANT_SALT_SECRET` / YAML
   `tenant_salt_secret`: the recommended setting (at least 16 characters). Every replica
   configured alike agrees, across restarts too, so cached prefixes survive a rollout.
2. With `--redis`: a random secret created once in Redis (`SET {prefix}:tenant-salt-secret
   ... NX`) and read back, so every replica sharing that Redis agrees. If Redis cannot be
   reached at startup the process uses a random secret of its own and says so: its tenants
   then miss the cache other replicas built (no leak, only lost reuse).
3. Otherwise a random secret made by the parent process (`--processes N` children inherit
   it through the config): one router instance agrees with itself; a restart starts the
   tenants' caches afresh.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.tenants.model import Tenant

if TYPE_CHECKING:
    from cache_client.redis_conn import RedisBackend

log = logging.getLogger("kvroute.tenants")

NO_TENANT_SCOPE = "none"
"""The scope of requests that match no tenant while tenants are configured: they share
cached prefixes with each other and with no tenant."""

SALT_PREFIX = "kvr1-"
"""Versions the derivation: a changed scheme must never produce a salt an old one did."""

MIN_SECRET_CHARS = 16
_DOMAIN = b"kvroute cache salt\x00"
_REDIS_KEY = ":tenant-salt-secret"


def derive_salt(secret: bytes, scope_id: str) -> str:
    """The cache salt of one scope (pure): the whole HMAC-SHA256, 256 bits as vLLM advises."""
    mac = hmac.new(secret, _DOMAIN + scope_id.encode("utf-8"), hashlib.sha256).hexdigest()
    return SALT_PREFIX + mac


def scope_of(tenant: Tenant | None) -> str:
    return tenant.scope_id if tenant is not None else NO_TENANT_SCOPE


class CacheSalter:
    """The salt of each request's scope, derived once per scope (a dict read per request).

    A lifecycle stage: `start()` settles the secret (configured, else shared through Redis,
    else this process's own) before the router serves."""

    def __init__(self, secret: bytes | None = None, *, redis: RedisBackend | None = None, prefix: str = "kvroute") -> None:
        self._secret = secret
        self._redis = redis
        self._prefix = prefix
        self._salts: dict[str, str] = {}
        self.source = "configured" if secret else "unset"
        """Where the secret came from: configured, redis, or process (logs and tests)."""

    async def start(self) -> None:
        if self._secret:
            return
        if self._redis is not None:
            shared = await shared_secret(self._redis, self._prefix)
            if shared:
                self._secret, self.source = shared, "redis"
                log.info("tenant cache salts: secret shared through Redis")
                return
            log.warning("tenant cache salts: no shared secret (Redis unreachable); this replica's tenants "
                        "will not reuse prefixes cached through other replicas")
        else:
            log.warning("tenant cache salts: no tenant_salt_secret configured; a random one is used, so "
                        "tenants' cached prefixes do not survive a restart")
        self._secret, self.source = random_secret().encode(), "process"

    async def stop(self) -> None:
        return None

    def salt_for(self, tenant: Tenant | None) -> str:
        scope = scope_of(tenant)
        salt = self._salts.get(scope)
        if salt is None:
            if not self._secret:
                raise RuntimeError("cache salts are derived only once started (CacheSalter.start)")
            salt = self._salts[scope] = derive_salt(self._secret, scope)
        return salt

    def known(self) -> list[str]:
        """The salts derived so far, the latest 32 (precise mode's event self-check)."""
        return list(self._salts.values())[-32:]

    def __repr__(self) -> str:  # never the secret, in a log or a traceback
        return f"CacheSalter(source={self.source}, scopes={len(self._salts)})"


@dataclass(frozen=True)
class IsolationSettings:
    """The `isolation` section: where the cache-salt secret comes from (see module doc)."""

    salt_secret: str | None = None
    """Prefer KVROUTE_TENANT_SALT_SECRET or the file: never a flag (it would show in ps)."""
    salt_secret_file: str | None = None

    def configured_secret(self) -> bytes | None:
        """The configured secret (file first), or None; ValueError if it is too short."""
        value = self.salt_secret
        if self.salt_secret_file:
            from router.auth import read_secret_lines

            lines = read_secret_lines(self.salt_secret_file)
            if len(lines) != 1:
                raise ValueError("the tenant salt secret file must hold exactly one line")
            value = lines[0]
        if value is None or not value.strip():
            return None
        value = value.strip()
        if len(value) < MIN_SECRET_CHARS:
            raise ValueError(f"the tenant salt secret must be at least {MIN_SECRET_CHARS} characters")
        return value.encode("utf-8")


def random_secret() -> str:
    return secrets.token_hex(32)


async def shared_secret(backend: RedisBackend, prefix: str, timeout_s: float = 5.0) -> bytes | None:
    """The deployment's secret in Redis, created by the first replica to ask (SET NX) and
    read by every other one; None if Redis did not answer within `timeout_s`."""
    import asyncio

    from cache_client.redact import exc_summary

    key = "{" + prefix + "}" + _REDIS_KEY
    client = backend.client()

    async def fetch() -> bytes | None:
        await client.execute_command("SET", key, random_secret(), "NX")
        value = await client.execute_command("GET", key)
        if value is None:
            return None
        return value if isinstance(value, bytes) else str(value).encode()

    try:
        return await asyncio.wait_for(fetch(), timeout_s)
    except Exception as exc:
        log.warning("tenant salt secret: Redis did not answer (%s)", exc_summary(exc))
        return None
