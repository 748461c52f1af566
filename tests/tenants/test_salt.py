"""Cache salts: derived from the tenant's cache scope with the router's secret (HMAC-SHA256),
stable, shared within a sharing group, distinct between scopes; and where the secret comes
from (configured, a file, Redis SET NX shared by replicas, else the process's own)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import uuid
from pathlib import Path

import pytest
import redis

from cache_client.redis_conn import RedisBackend, parse_redis_url
from router.config_loader import build_parser, load_config
from router.tenants.model import Tenant
from router.tenants.salt import (
    NO_TENANT_SCOPE,
    SALT_PREFIX,
    CacheSalter,
    IsolationSettings,
    derive_salt,
    shared_secret,
)
from tests.support.system_redis import SYSTEM_REDIS

SECRET = b"a-long-enough-test-secret"
ALICE = Tenant("alice", ("key-a",))
BOB = Tenant("bob", ("key-b",))
CAROL = Tenant("carol", ("key-c",), cache_scope="research")
DAVE = Tenant("dave", ("key-d",), cache_scope="research")


def test_salt_is_the_hmac_of_the_scope() -> None:
    expected = hmac.new(SECRET, b"kvroute cache salt\x00tenant:alice", hashlib.sha256).hexdigest()
    assert derive_salt(SECRET, ALICE.scope_id) == SALT_PREFIX + expected


def test_salts_are_stable_per_scope_and_shared_within_a_group() -> None:
    salter = CacheSalter(SECRET)
    assert salter.salt_for(ALICE) == salter.salt_for(ALICE) == CacheSalter(SECRET).salt_for(ALICE)
    assert salter.salt_for(CAROL) == salter.salt_for(DAVE)  # one sharing group, one salt
    salts = {salter.salt_for(t) for t in (ALICE, BOB, CAROL, None)}
    assert len(salts) == 4  # private tenants, the group and the tenantless scope all differ
    assert salter.salt_for(None) == derive_salt(SECRET, NO_TENANT_SCOPE)


def test_a_tenant_named_like_a_group_gets_another_salt() -> None:
    # Scope ids are typed ("tenant:" / "group:"), so a private tenant called "research"
    # never lands in the "research" group's scope.
    research = Tenant("research", ("key-r",))
    assert CacheSalter(SECRET).salt_for(research) != CacheSalter(SECRET).salt_for(CAROL)


def test_salts_depend_on_the_secret_and_never_show_it() -> None:
    other = CacheSalter(b"another-long-enough-secret")
    assert other.salt_for(ALICE) != CacheSalter(SECRET).salt_for(ALICE)
    salter = CacheSalter(SECRET)
    salter.salt_for(ALICE)
    assert SECRET.decode() not in repr(salter)
    assert SECRET.hex() not in salter.salt_for(ALICE)


def test_an_unstarted_salter_without_a_secret_refuses() -> None:
    with pytest.raises(RuntimeError):
        CacheSalter().salt_for(ALICE)


async def test_without_secret_or_redis_the_process_makes_its_own() -> None:
    one, two = CacheSalter(), CacheSalter()
    await one.start()
    await two.start()
    assert one.source == two.source == "process"
    assert one.salt_for(ALICE) != two.salt_for(ALICE)


def test_secret_from_file_env_or_yaml_never_a_flag(tmp_path: Path) -> None:
    path = tmp_path / "salt"
    path.write_text("# the tenants' salt secret\nfile-secret-0123456789\n")
    config = load_config(["--worker", "http://127.0.0.1:1", "--tenant-salt-secret-file", str(path)], {})
    assert config.isolation.configured_secret() == b"file-secret-0123456789"
    config = load_config(["--worker", "http://127.0.0.1:1"], {"KVROUTE_TENANT_SALT_SECRET": "env-secret-0123456789"})
    assert config.isolation.configured_secret() == b"env-secret-0123456789"
    yaml_file = tmp_path / "kvroute.yaml"
    yaml_file.write_text("isolation:\n  salt_secret: yaml-secret-0123456789\n")
    config = load_config(["--config", str(yaml_file), "--worker", "http://127.0.0.1:1"], {})
    assert config.isolation.configured_secret() == b"yaml-secret-0123456789"
    assert "--tenant-salt-secret" not in build_parser().format_help().split()  # only the -file flag
    # argparse reads the abbreviation as the file flag: a secret given on the command line
    # is taken for a path (and fails to open), never for the secret.
    args = vars(build_parser().parse_args(["--tenant-salt-secret", "on-the-command-line-0123"]))
    assert args == {"tenant_salt_secret_file": "on-the-command-line-0123"}


def test_a_short_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 16"):
        IsolationSettings(salt_secret="short").configured_secret()


@pytest.mark.redis
async def test_replicas_agree_on_a_secret_created_once_in_redis() -> None:
    prefix = f"test-salt-{uuid.uuid4().hex[:10]}"
    backends = [RedisBackend(parse_redis_url(SYSTEM_REDIS)) for _ in range(4)]
    try:
        salters = [CacheSalter(redis=b, prefix=prefix) for b in backends]
        await asyncio.gather(*(s.start() for s in salters))  # four replicas starting at once
        assert {s.source for s in salters} == {"redis"}
        assert len({s.salt_for(ALICE) for s in salters}) == 1
        assert salters[0].salt_for(ALICE) != salters[0].salt_for(BOB)
        # A replica started later (a rollout) reads the same secret.
        again = await shared_secret(backends[0], prefix)
        later = CacheSalter(again)
        assert later.salt_for(ALICE) == salters[0].salt_for(ALICE)
    finally:
        for b in backends:
            await b.close()
        with redis.Redis.from_url(SYSTEM_REDIS) as c:
            keys = list(c.scan_iter(match="{" + prefix + "}*"))
            assert keys == [("{" + prefix + "}:tenant-salt-secret").encode()]
            c.delete(*keys)


async def test_unreachable_redis_falls_back_to_a_process_secret() -> None:
    backend = RedisBackend(parse_redis_url("redis://127.0.0.1:1/0"), connect_timeout_s=0.2, socket_timeout_s=0.2)
    try:
        salter = CacheSalter(redis=backend, prefix="unreachable")
        await salter.start()
        assert salter.source == "process"
        assert salter.salt_for(ALICE).startswith(SALT_PREFIX)
    finally:
        await backend.close()


def test_processes_without_redis_or_secret_share_the_parents(tmp_path: Path) -> None:
    from router.config_loader import config_from_json, config_to_json
    from router.serve import check_secrets, with_process_secret

    base = ["--worker", "http://127.0.0.1:1", "--processes", "2"]
    handed = with_process_secret(load_config(base, {}))
    secret = handed.isolation.configured_secret()
    assert secret and config_from_json(config_to_json(handed)).isolation.configured_secret() == secret
    shared = load_config([*base, "--redis", SYSTEM_REDIS], {})
    assert with_process_secret(shared).isolation.configured_secret() is None  # Redis decides
    (tmp_path / "short").write_text("short\n")
    with pytest.raises(SystemExit, match="at least 16"):
        check_secrets(load_config([*base, "--tenant-salt-secret-file", str(tmp_path / "short")], {}))
    with pytest.raises(SystemExit, match="cannot read --tenant-salt-secret-file"):
        check_secrets(load_config([*base, "--tenant-salt-secret-file", str(tmp_path / "missing")], {}))
