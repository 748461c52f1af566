"""The tenants file (`kvroute serve --tenants FILE`, `KVROUTE_TENANTS`, config `tenants_file`):

    groups: [acme]                    # sharing groups: tenants naming one share cached prefixes
    tenants:
      alice:
        keys: [sk-alice-1, sk-alice-2]
        cache_scope: private          # the default
        weight: 2                     # fair share under overload (default 1)
        limits: {requests_per_s: 10, tokens_per_min: 200000, concurrent: 16}
      acme-eu: {keys: [sk-eu], cache_scope: acme}
      acme-us: {keys: [sk-us], cache_scope: acme}

Every error names the file and the line (`TenantConfigError`): a duplicate key or tenant,
an unknown sharing group, a malformed limit, an unknown field. Startup refuses such a file;
a reload keeps the tables it had (`TenantRegistry.reload`), so a router never runs with
half a config. The file holds client keys: messages name tenants and lines, never a key.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from router.tenants.model import PRIVATE_SCOPE, Tenant, TenantLimits, TenantTable


@dataclass(frozen=True)
class TenantSettings:
    """The `tenants` section of the router's config."""

    file: str | None = None
    """The tenants file; None: no tenants (every key shares one cache scope and the global limits)."""
    replicas: int = 0
    """Router replicas sharing the limits through Redis, for the per-replica share each
    enforces while Redis is unreachable (limit ÷ replicas). 0: the live replicas the load
    board last saw in Redis (every process of every router counts)."""
    concurrency_lease_s: float = 600.0
    """A request in flight holds its tenant's concurrency slot in Redis at most this long:
    the slots of a replica that died free themselves after it."""


class TenantConfigError(ValueError):
    def __init__(self, path: str, node: Node | None, message: str, line: int | None = None) -> None:
        if node is not None:
            line = node.start_mark.line + 1
        super().__init__(f"{path}:{line}: {message}" if line is not None else f"{path}: {message}")


_TENANT_FIELDS = {"keys", "cache_scope", "weight", "limits"}
_LIMIT_FIELDS = {"requests_per_s": float, "tokens_per_min": int, "concurrent": int}


class _Reader:
    """Walks the composed YAML nodes (which keep their line numbers) of one file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, node: Node | None, message: str) -> TenantConfigError:
        return TenantConfigError(self.path, node, message)

    def mapping(self, node: Node, what: str) -> list[tuple[str, Node, Node]]:
        """(key, key node, value node) of a mapping with unique string keys."""
        if not isinstance(node, MappingNode):
            raise self.fail(node, f"{what} must be a mapping")
        seen: dict[str, Node] = {}
        items = []
        for key_node, value_node in node.value:
            if not isinstance(key_node, ScalarNode) or not key_node.value:
                raise self.fail(key_node, f"{what}: keys must be names")
            if key_node.value in seen:
                line = seen[key_node.value].start_mark.line + 1
                raise self.fail(key_node, f"{what}: {key_node.value!r} given twice (first on line {line})")
            seen[key_node.value] = key_node
            items.append((key_node.value, key_node, value_node))
        return items

    def strings(self, node: Node, what: str) -> list[tuple[str, Node]]:
        if not isinstance(node, SequenceNode):
            raise self.fail(node, f"{what} must be a list")
        out = []
        for item in node.value:
            if not isinstance(item, ScalarNode) or not str(item.value).strip():
                raise self.fail(item, f"{what}: each item must be a non-empty string")
            out.append((str(item.value).strip(), item))
        return out

    def number(self, node: Node, what: str, kind: Callable[[Any], float | int]) -> float | int:
        value = yaml.safe_load(yaml.serialize(node)) if isinstance(node, ScalarNode) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(node, f"{what} must be a number, not {getattr(node, 'value', '?')!r}")
        if kind is int and value != int(value):
            raise self.fail(node, f"{what} must be a whole number, not {value}")
        if not math.isfinite(value) or value <= 0:
            raise self.fail(node, f"{what} must be greater than 0, not {value}")
        return kind(value)


def parse_tenants(text: str, path: str = "<tenants>") -> TenantTable:
    """The table `text` describes; TenantConfigError (naming the line) if anything is wrong."""
    reader = _Reader(path)
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        raise TenantConfigError(path, None, f"not valid YAML: {getattr(exc, 'problem', exc)}", line) from None
    if root is None:
        raise reader.fail(None, "empty file: expected 'tenants:'")
    top = dict((k, (kn, v)) for k, kn, v in reader.mapping(root, "the file"))
    unknown = set(top) - {"tenants", "groups"}
    if unknown:
        name = sorted(unknown)[0]
        raise reader.fail(top[name][0], f"unknown field {name!r} (expected 'tenants' and optional 'groups')")
    if "tenants" not in top:
        raise reader.fail(root, "no 'tenants:' mapping")
    groups = {name for name, _ in reader.strings(top["groups"][1], "groups")} if "groups" in top else set()
    if PRIVATE_SCOPE in groups:
        raise reader.fail(top["groups"][1], f"{PRIVATE_SCOPE!r} is not a group name (it means no sharing)")
    tenants = [_tenant(reader, name, node, groups) for name, _, node in reader.mapping(top["tenants"][1], "tenants")]
    if not tenants:
        raise reader.fail(top["tenants"][1], "no tenant defined")
    _check_keys_unique(reader, tenants)
    return TenantTable(tenant for tenant, _ in tenants)


def _tenant(reader: _Reader, name: str, node: Node, groups: set[str]) -> tuple[Tenant, list[tuple[str, Node]]]:
    fields = {k: (kn, v) for k, kn, v in reader.mapping(node, f"tenant {name!r}")}
    for field_name, (key_node, _) in fields.items():
        if field_name not in _TENANT_FIELDS:
            raise reader.fail(key_node, f"tenant {name!r}: unknown field {field_name!r}")
    if "keys" not in fields:
        raise reader.fail(node, f"tenant {name!r}: no 'keys'")
    keys = reader.strings(fields["keys"][1], f"tenant {name!r} keys")
    if not keys:
        raise reader.fail(fields["keys"][1], f"tenant {name!r}: 'keys' is empty")
    scope = PRIVATE_SCOPE
    if "cache_scope" in fields:
        scope_node = fields["cache_scope"][1]
        scope = str(getattr(scope_node, "value", ""))
        if not isinstance(scope_node, ScalarNode) or (scope != PRIVATE_SCOPE and scope not in groups):
            known = ", ".join(sorted(groups)) or "none declared under 'groups:'"
            raise reader.fail(scope_node, f"tenant {name!r}: unknown sharing group {scope!r} (groups: {known})")
    weight = float(reader.number(fields["weight"][1], f"tenant {name!r} weight", float)) if "weight" in fields else 1.0
    limits = _limits(reader, name, fields["limits"][1]) if "limits" in fields else TenantLimits()
    tenant = Tenant(name=name, keys=tuple(k for k, _ in keys), cache_scope=scope, weight=weight, limits=limits)
    return tenant, keys


def _limits(reader: _Reader, name: str, node: Node) -> TenantLimits:
    values: dict[str, Any] = {}
    for field_name, key_node, value_node in reader.mapping(node, f"tenant {name!r} limits"):
        kind = _LIMIT_FIELDS.get(field_name)
        if kind is None:
            expected = ", ".join(_LIMIT_FIELDS)
            raise reader.fail(key_node, f"tenant {name!r}: unknown limit {field_name!r} (limits: {expected})")
        values[field_name] = reader.number(value_node, f"tenant {name!r} limits.{field_name}", kind)
    return TenantLimits(**values)


def _check_keys_unique(reader: _Reader, tenants: list[tuple[Tenant, list[tuple[str, Node]]]]) -> None:
    owner: dict[str, tuple[str, Node]] = {}
    for tenant, keys in tenants:
        for key, node in keys:
            if key in owner:
                first, first_node = owner[key]
                line = first_node.start_mark.line + 1
                whose = "again" if first == tenant.name else f"also to tenant {first!r}"
                raise reader.fail(node, f"tenant {tenant.name!r}: a key given {whose} (line {line})")
            owner[key] = (tenant.name, node)


def load_tenants(path: str) -> TenantTable:
    """The tenants file at `path`; TenantConfigError naming the line, or OSError."""
    with open(path, encoding="utf-8") as fh:
        return parse_tenants(fh.read(), path)


class TenantRegistry:
    """The tenants in force, swapped whole on reload (SIGHUP or `POST /admin/tenants/reload`).
    Requests read `table` once when they start, so a reload never changes a request in
    flight; a file that fails to load leaves the old table in force."""

    def __init__(self, path: str | None, table: TenantTable | None = None) -> None:
        self.path = path
        self.table: TenantTable | None = table if table is not None or path is None else load_tenants(path)
        self.reloads = 0

    @property
    def enabled(self) -> bool:
        return self.table is not None

    def for_key(self, key: bytes | None) -> Tenant | None:
        table = self.table
        return table.for_key(key) if table is not None else None

    def reload(self) -> TenantTable:
        """Read the file again and put it in force; raises (and keeps the old table) if it is bad."""
        if self.path is None:
            raise TenantConfigError("<none>", None, "no tenants file is configured")
        table = load_tenants(self.path)
        self.table = table
        self.reloads += 1
        return table
