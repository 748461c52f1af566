"""The tenants file: what it describes, and a clear error naming the line for every mistake
(the bad-input table: a duplicate key, an unknown sharing group, a malformed limit)."""

from __future__ import annotations

import pytest

from router.tenants.loader import TenantConfigError, TenantRegistry, parse_tenants
from router.tenants.model import PRIVATE_SCOPE, TenantLimits

GOOD = """\
groups: [acme]
tenants:
  alice:
    keys: [sk-alice-1, sk-alice-2]
    weight: 2
    limits: {requests_per_s: 10, tokens_per_min: 200000, concurrent: 16}
  acme-eu: {keys: [sk-eu], cache_scope: acme}
  acme-us: {keys: [sk-us], cache_scope: acme}
"""


def test_the_file_describes_tenants_scopes_weights_and_limits() -> None:
    table = parse_tenants(GOOD)
    alice = table.for_key(b"sk-alice-2")
    assert alice is not None and alice.name == "alice"
    assert alice.cache_scope == PRIVATE_SCOPE and alice.weight == 2.0
    assert alice.limits == TenantLimits(requests_per_s=10.0, tokens_per_min=200000, concurrent=16)
    eu, us = table.for_key(b"sk-eu"), table.for_key(b"sk-us")
    assert eu is not None and us is not None
    assert eu.scope_id == us.scope_id != alice.scope_id
    assert eu.limits == TenantLimits() and eu.weight == 1.0
    assert table.for_key(b"sk-alice") is None and table.for_key(None) is None and table.for_key(b"") is None


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("tenants:\n  a: {keys: [k1]}\n  b: {keys: [k2, k1]}\n", 3, "also to tenant 'a' (line 2)"),
        ("tenants:\n  a: {keys: [k1, k1]}\n", 2, "a key given again"),
        ("tenants:\n  a: {keys: [k1]}\n  a: {keys: [k2]}\n", 3, "'a' given twice (first on line 2)"),
        ("groups: [acme]\ntenants:\n  a:\n    keys: [k1]\n    cache_scope: acne\n", 5, "unknown sharing group 'acne'"),
        ("tenants:\n  a:\n    keys: [k1]\n    limits: {requests_per_s: fast}\n", 4, "must be a number, not 'fast'"),
        ("tenants:\n  a:\n    keys: [k1]\n    limits: {concurrent: 2.5}\n", 4, "must be a whole number"),
        ("tenants:\n  a:\n    keys: [k1]\n    limits: {tokens_per_min: -5}\n", 4, "greater than 0"),
        ("tenants:\n  a:\n    keys: [k1]\n    limits: {rps: 5}\n", 4, "unknown limit 'rps'"),
        ("tenants:\n  a:\n    keys: [k1]\n    wieght: 2\n", 4, "unknown field 'wieght'"),
        ("tenants:\n  a:\n    keys: [k1]\n    weight: 0\n", 4, "greater than 0"),
        ("tenants:\n  a:\n    keys: []\n", 3, "'keys' is empty"),
        ("tenants:\n  a:\n    weight: 1\n", 3, "no 'keys'"),
        ("tenant:\n  a: {keys: [k]}\n", 1, "unknown field 'tenant'"),
        ("tenants:\n  a: {keys: [k]\n", 3, "not valid YAML"),
        ("groups: [private]\ntenants:\n  a: {keys: [k]}\n", 1, "not a group name"),
    ],
)
def test_every_mistake_names_its_line(text: str, line: int, words: str) -> None:
    with pytest.raises(TenantConfigError) as err:
        parse_tenants(text, "tenants.yaml")
    message = str(err.value)
    assert message.startswith(f"tenants.yaml:{line}: "), message
    assert words in message


def test_a_message_never_shows_a_key() -> None:
    with pytest.raises(TenantConfigError) as err:
        parse_tenants("tenants:\n  a: {keys: [sk-secret-1]}\n  b: {keys: [sk-secret-1]}\n")
    assert "sk-secret" not in str(err.value)


def test_a_bad_reload_keeps_the_tenants_in_force(tmp_path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(GOOD)
    registry = TenantRegistry(str(path))
    assert registry.for_key(b"sk-eu") is not None
    path.write_text("tenants:\n  a: {keys: [k1]}\n  b: {keys: [k1]}\n")
    with pytest.raises(TenantConfigError):
        registry.reload()
    assert registry.for_key(b"sk-eu") is not None and registry.reloads == 0
    path.write_text("tenants:\n  zed: {keys: [sk-zed]}\n")
    registry.reload()
    assert registry.for_key(b"sk-eu") is None and registry.for_key(b"sk-zed").name == "zed"
    assert registry.reloads == 1


def test_no_file_no_tenants() -> None:
    registry = TenantRegistry(None)
    assert not registry.enabled and registry.for_key(b"anything") is None
