"""The one place the router's configuration is built: flags, `KVROUTE_*` environment
variables and a YAML file -> `RouterConfig`. No other module reads the environment; what
the rest of the router needs from it (an `api_key_env` named at runtime, Kubernetes'
`KUBERNETES_SERVICE_HOST`) comes from the snapshot `environment()` takes here.

Every setting has one flat name (`FLAT_KEYS`: `kv_capacity_tokens`, `redis_prefix`,
`tokenizer`, ...), which is its flag (`--kv-capacity-tokens`), its environment variable
(`KVROUTE_KV_CAPACITY_TOKENS`) and its YAML key, and lands on one field of one section
(`index.kv_capacity_tokens`, `redis.prefix`, `precise.tokenizer`). YAML also takes the
sections themselves: `redis: {url: ..., prefix: ...}` (a string under `redis` is the URL,
as ever). Precedence: flag > environment > YAML file > default.

`--processes N` children get the parent's config object itself: the parent serializes it
(`config_to_json`) into one variable that only `config_for_child` reads back.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from typing import Any

import orjson

from cache_client.kv_events import CpuMedium
from router.config import RouterConfig
from router.policies import POLICIES
from router.policies.cache_aware import TERMS
from router.policies.disagg import CONNECTORS, SPLITS
from router.workers import WorkerSpec, check_role, parse_worker_arg

ENV_PREFIX = "KVROUTE_"
CHILD_CONFIG_ENV = "KVROUTE__SERVE_CONFIG_JSON"
"""Carries the parent's config to `--processes N` children (uvicorn re-imports the app)."""

Slot = tuple[str | None, str]
"""(section, field) of RouterConfig; section None: a top-level field (workers, discover)."""


def _same(section: str, *names: str) -> dict[str, Slot]:
    return {name: (section, name) for name in names}


def _prefixed(section: str, prefix: str, *names: str) -> dict[str, Slot]:
    return {prefix + name: (section, name) for name in names}


FLAT_KEYS: dict[str, Slot] = {
    "workers": (None, "workers"),
    "discover": (None, "discover"),
    "nodes": (None, "nodes"),
    "roles": (None, "roles"),
    **_same("routing", "policy"),
    **_same("server", "host", "port", "processes", "log_level"),
    "redis": ("redis", "url"),
    **_prefixed("redis", "redis_", "prefix", "ttl_s", "lookup_budget_ms"),
    **_same(
        "index", "kv_capacity_tokens", "pool_capacity_tokens", "disk_capacity_tokens", "remote_capacity_tokens",
        "remote_write_through", "responses_owner_ttl_s",
    ),
    **_same("routing", "load_factor", "recent_half_life_s", "random_seed"),
    "policy_ablate": ("routing", "ablate"),
    **_prefixed(
        "cost", "cost_", "prefill_base_us", "prefill_ctx_ns", "pool_load_us", "inflight_penalty_ms", "step_ms", "learning",
        "disk_load_us", "remote_load_us",
    ),
    **_same("cost", "kv_bytes_per_token", "disk_gbytes_s", "remote_gbps"),
    **_same("media", "image_rule", "image_tokens_default", "audio_tokens", "video_tokens"),
    "normalize_tool_schemas": ("normalize", "tool_schemas"),
    "normalize_tool_arguments": ("normalize", "tool_call_arguments"),
    "normalize_system_prompt": ("normalize", "system_prompt"),
    **_same(
        "proxy", "max_body_bytes", "max_attempts", "connect_timeout_s", "first_byte_timeout_s", "idle_timeout_s",
        "total_timeout_s", "max_connections", "forward_client_auth", "upstream_client",
    ),
    "health_interval_s": ("health", "interval_s"),
    **_same("health", "unhealthy_after", "scrape_metrics"),
    "breaker_failures": ("breaker", "failure_threshold"),
    **_prefixed("breaker", "breaker_", "open_s", "max_open_s"),
    **_prefixed(
        "outlier", "outlier_", "interval_s", "min_requests", "error_rate", "latency_factor", "ejection_s",
        "max_ejected_fraction",
    ),
    **_same("overload", "max_inflight_per_worker", "queue_size", "queue_timeout_s", "retry_after_s", "prefill_queue_tokens"),
    **_same("server", "shutdown_grace_s", "keep_alive_s"),
    **_same("security", "api_keys", "api_keys_file", "admin_token", "admin_token_file"),
    **_same("precise", "tokenizer", "block_size", "hash_algo", "hash_seed", "kv_events", "kv_events_discover", "kv_events_cpu"),
    "tenants_file": ("tenants", "file"),
    "tenant_replicas": ("tenants", "replicas"),
    "tenant_concurrency_lease_s": ("tenants", "concurrency_lease_s"),
    **_prefixed("isolation", "tenant_", "salt_secret", "salt_secret_file"),
    "epp_listen": ("epp", "listen"),
    **_prefixed("epp", "epp_", "tls_cert_file", "tls_key_file", "self_signed_tls"),
    **_same("tracing", "otlp_endpoint", "otlp_protocol"),
    **_prefixed("tracing", "trace_", "sample_ratio", "service_name"),
    **_prefixed("disagg", "pd_", "itl_budget_ms", "stall_weight", "chunk_tokens", "link_gbps", "hold_timeout_s", "split", "connector"),
}
"""Flat setting name -> where it lands. Each is a flag, a KVROUTE_* variable and a YAML key."""

NO_FLAG = frozenset({"tenant_salt_secret"})
"""Secrets set only by environment or YAML (a flag would show them in ps)."""

LIST_FLAGS = {
    "workers": "--worker", "discover": "--discover", "nodes": "--node", "api_keys": "--api-keys",
    "kv_events": "--kv-events", "roles": "--role",
}  # fmt: skip
"""Repeatable flags, named in the singular where they take one item."""

ALIASES = {"tenants_file": "--tenants"}
"""Settings whose flag (and KVROUTE_* variable) is also known by a shorter name."""

HELP = {
    "otlp_endpoint": "export OpenTelemetry traces of each request to this OTLP collector: http://HOST:4318 "
    "(http) or http://HOST:4317 (grpc); off when unset (env OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT too; "
    "needs kvroute[tracing]; see docs/tracing.md)",
    "otlp_protocol": "OTLP transport: http (protobuf over HTTP, the default) or grpc (env OTEL_EXPORTER_OTLP_PROTOCOL too)",
    "trace_sample_ratio": "share of new traces recorded, 0..1 (default 1); a client's traceparent keeps its own "
    "sampling decision (env OTEL_TRACES_SAMPLER_ARG too)",
    "trace_service_name": "service.name of the router's spans (default kvroute; env OTEL_SERVICE_NAME too)",
    "workers": "a worker as NAME=URL or URL (repeatable)",
    "discover": "discover workers, e.g. dns://HEADLESS_SERVICE:PORT (repeatable)",
    "policy": "routing policy",
    "random_seed": "random policy only: pick by a hash of this seed and the request's prefix, so the same "
    "request goes to the same worker in every run with this seed (common random numbers for benchmarks)",
    "policy_ablate": "cache_aware only, for measuring: switch off these terms of the policy, comma-separated "
    f"({', '.join(TERMS)}; see docs/policy.md)",
    "redis": "share the index through Redis: redis://[:PASSWORD@]HOST:PORT/DB, rediss://... (TLS), "
    "redis+cluster://HOST:PORT[,HOST:PORT...] or ?cluster=true (Redis Cluster); see docs/redis.md",
    "redis_prefix": "key prefix (and Redis Cluster hash tag) of this deployment's index in Redis",
    "redis_ttl_s": "Redis index entries unused for this many seconds expire",
    "redis_lookup_budget_ms": "longest a lookup waits for Redis before routing on the local view",
    "image_rule": "how an image's prompt tokens are counted from its size: auto (by the model's name), "
    "qwen2_vl, pixtral, llava, gemma3, or fixed:N (see normalizer/media.py)",
    "image_tokens_default": "tokens of an image whose size cannot be read or whose model has no known rule",
    "audio_tokens": "tokens of one audio clip in a prompt",
    "video_tokens": "tokens of one video in a prompt",
    "nodes": "the workers on one node, NODE=W1,W2,... (repeatable; env KVROUTE_NODES ;-separated): each node's "
    "workers share its LMCache pool and disk tier; workers on no node share the default one",
    "roles": "a worker's role in a prefill/decode-disaggregated fleet, NAME=prefill|decode|both (repeatable; "
    "env KVROUTE_ROLES comma-separated); workers given none are both, and a fleet of only both is aggregated",
    "pd_itl_budget_ms": "disaggregated fleets: the stall per inter-token gap a decode worker's local prefill may add "
    "to its running streams at no charge; beyond it the stall is priced like time to first token against the split "
    "(see docs/disaggregation.md)",
    "pd_stall_weight": "disaggregated fleets: the seconds of time to first token one second of stall beyond the "
    "inter-token budget, in one running decode, is worth (large: the budget is a hard limit)",
    "pd_chunk_tokens": "disaggregated fleets: the decode workers' max_num_batched_tokens (a local prefill stalls one "
    "inter-token gap per chunk of this many tokens)",
    "pd_link_gbps": "disaggregated fleets: bandwidth of the KV link between prefill and decode workers, Gb/s",
    "pd_hold_timeout_s": "disaggregated fleets: how long a prefill worker holds unread KV "
    "(vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT); older params are not sent to a decode worker",
    "pd_split": "disaggregated fleets: auto (split a request only where the cost model says it pays) or "
    "always (every request a prefill worker can take, as vLLM's own proxy does)",
    "pd_connector": "disaggregated fleets: how the workers' KV connector hands P's KV to D: nixl (vLLM's "
    "NixlConnector: P's answer carries kv_transfer_params for D) or shared-storage (a directory every worker "
    "reads, keyed by the prompt's tokens, as vLLM's ExampleConnector: no params; D gets the client's own body)",
    "pool_capacity_tokens": "each node's workers share an LMCache CPU pool of this many tokens (0: no pool)",
    "disk_capacity_tokens": "each node's LMCache server keeps a disk tier of this many tokens (0: none)",
    "remote_capacity_tokens": "a remote tier every node reads over the network (LMCache's remote backend) "
    "of this many tokens (0: none)",
    "remote_write_through": "workers write what they compute to the remote tier too (LMCache's default; "
    "--no-remote-write-through: only KV events say what it holds)",
    "kv_bytes_per_token": "KV bytes of one token (all layers, K and V), to price the disk and remote tiers "
    "from their bandwidths (default: Llama-3-8B in bf16, 131072)",
    "disk_gbytes_s": "read bandwidth of a node's disk tier in GB/s (default 7: a PCIe 4.0 NVMe drive)",
    "remote_gbps": "network bandwidth to the remote tier in Gb/s (default 100)",
    "cost_disk_load_us": "µs to load a token's KV from the node's disk tier (default: from --kv-bytes-per-token "
    "and --disk-gbytes-s, plus the pool's copy)",
    "cost_remote_load_us": "µs to load a token's KV from the remote tier (default: from --kv-bytes-per-token "
    "and --remote-gbps, plus the pool's copy)",
    "kv_capacity_tokens": "KV capacity of each worker in tokens, for the LRU capacity model",
    "responses_owner_ttl_s": "how long the router remembers which worker stores a /v1/responses response "
    "(previous_response_id and GET/DELETE /v1/responses/{id} go there)",
    "processes": "router processes on one port (share state through --redis)",
    "api_keys": "client API keys accepted on /v1/* (comma-separated, repeatable; env KVROUTE_API_KEYS); "
    "prefer --api-keys-file, a flag shows in ps",
    "api_keys_file": "file of client API keys, one a line (# comments)",
    "admin_token": "token for /admin/* and /debug/route; prefer env KVROUTE_ADMIN_TOKEN or --admin-token-file",
    "admin_token_file": "file holding the admin token",
    "cost_learning": "on (default): learn each worker's costs online, the --cost-* values being priors "
    "(one set explicitly is held fixed); off: fixed costs",
    "upstream_client": "forwarding client: raw (default), or httpx / aiohttp to compare in benchmarks",
    "max_inflight_per_worker": "requests in flight to one worker before new ones queue (0: no limit)",
    "queue_size": "requests that may wait for a worker slot; beyond, 429 with Retry-After",
    "queue_timeout_s": "longest a request waits for a worker slot before 429 (and in the prefill queue)",
    "prefill_queue_tokens": "the engines' max_num_batched_tokens, to hold requests in the router while every "
    "worker has a full step of prefill queued and route them as workers free, earliest arrival + predicted prefill first "
    "(0: off, the default; docs/reliability.md)",
    "shutdown_grace_s": "on SIGTERM, how long in-flight requests and streams may take to finish",
    "keep_alive_s": "idle client connections are kept this long (longer than clients keep theirs)",
    "breaker_failures": "consecutive failures that open a worker's circuit (0: never)",
    "outlier_interval_s": "how often error-rate/latency outliers are judged and ejected (0: off)",
    "tokenizer": "precise mode: model dir (tokenizer.json + tokenizer_config.json); see docs/precise.md",
    "block_size": "precise mode: vLLM block size (default: the workers' vllm:cache_config_info)",
    "hash_algo": "precise mode: sha256 | sha256_cbor (default: the workers' cache_config_info)",
    "hash_seed": "precise mode: the workers' PYTHONHASHSEED, if they set one",
    "kv_events": "precise mode: a worker's KV-event publisher, NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT]"
    "[,topic=T] (repeatable; env KVROUTE_KV_EVENTS ;-separated)",
    "kv_events_discover": "precise mode: ask workers without --kv-events for /kv_event_sources (default on)",
    "kv_events_cpu": "precise mode: where CPU-medium events go: pool (default), worker or ignore",
    "tenants_file": "tenants file (YAML: keys, cache scope, weight, limits per tenant; see docs/tenants.md); "
    "reloaded on SIGHUP or POST /admin/tenants/reload (env KVROUTE_TENANTS)",
    "tenant_replicas": "tenants: router replicas sharing the limits, for the share each enforces while "
    "Redis is unreachable (0: as many as the load board last saw in Redis)",
    "tenant_concurrency_lease_s": "tenants: longest a request holds its tenant's concurrency slot in Redis "
    "(slots of a replica that died free after it)",
    "epp_listen": "kvroute epp only: HOST:PORT of its gRPC server (the gateway's ext_proc calls and gRPC health)",
    "epp_tls_cert_file": "kvroute epp only: serve gRPC over TLS with this certificate (PEM, with --epp-tls-key-file)",
    "epp_tls_key_file": "kvroute epp only: the key of --epp-tls-cert-file (PEM)",
    "epp_self_signed_tls": "kvroute epp only: serve gRPC over TLS with a certificate made at start (gateways that "
    "encrypt without verifying the picker, e.g. kgateway)",
    "tenant_salt_secret_file": "tenants: file holding the secret the per-tenant cache salts derive from "
    "(or env KVROUTE_TENANT_SALT_SECRET); see docs/tenants.md",
}

TOP_LEVEL = ("workers", "discover", "nodes", "roles")
SECTIONS: dict[str, type] = {
    f.name: f.default_factory for f in dataclasses.fields(RouterConfig) if f.name not in TOP_LEVEL  # type: ignore[misc]
}
"""Section name -> its dataclass (each defined beside the component that takes it)."""

_HINT_NAMES = {"CpuMedium": CpuMedium}
"""Names the sections' annotations use only under TYPE_CHECKING."""


def _field_type(slot: Slot) -> type:
    section, name = slot
    owner = RouterConfig if section is None else SECTIONS[section]
    hint = typing.get_type_hints(owner, localns=_HINT_NAMES)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is typing.Literal:
        return str
    return typing.get_origin(hint) or hint


def build_parser(prog: str = "kvroute serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="KV-cache-aware OpenAI-compatible router for vLLM workers. Every flag is also an "
        "environment variable (--kv-capacity-tokens: KVROUTE_KV_CAPACITY_TOKENS) and a YAML key "
        "(kv_capacity_tokens, or nested by section: index: {kv_capacity_tokens: ...}).",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", help="YAML config file (env KVROUTE_CONFIG)")
    for name, slot in FLAT_KEYS.items():
        if name in NO_FLAG:
            continue
        help_ = HELP.get(name, "")
        if name in LIST_FLAGS:
            parser.add_argument(LIST_FLAGS[name], dest=name, action="append", help=help_)
            continue
        flag = "--" + name.replace("_", "-")
        if name in ALIASES:
            parser.add_argument(ALIASES[name], flag, dest=name, type=_field_type(slot), help=help_)
            continue
        kind = _field_type(slot)
        if kind is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, help=help_)
        elif name == "policy":
            parser.add_argument(flag, dest=name, choices=sorted(POLICIES), help=help_)
        elif name == "policy_ablate":
            parser.add_argument(flag, dest=name, help=help_)
        elif name == "cost_learning":
            parser.add_argument(flag, dest=name, choices=("on", "off"), help=help_)
        elif name == "pd_split":
            parser.add_argument(flag, dest=name, choices=SPLITS, help=help_)
        elif name == "pd_connector":
            parser.add_argument(flag, dest=name, choices=CONNECTORS, help=help_)
        else:
            parser.add_argument(flag, dest=name, type=kind, help=help_)
    return parser


def _items(value: Any, sep: str) -> list[Any]:
    return value.split(sep) if isinstance(value, str) else list(value)


def _coerce(slot: Slot, value: Any, env: Mapping[str, str]) -> Any:
    name = slot[1]
    if name == "workers":
        return [_worker(v, env) for v in _items(value, ",") if v]
    if name == "discover":
        return [v for v in _items(value, ",") if v]
    if name == "nodes":
        return _nodes(value)
    if name == "roles":
        return _roles(value)
    if name == "api_keys":
        items = [value] if isinstance(value, str) else list(value)
        return [k.strip() for item in items for k in str(item).split(",") if k.strip()]
    if name == "ablate":
        return tuple(t.strip() for t in _items(value, ",") if t.strip())
    if name == "kv_events":  # an endpoint holds commas (",replay=..."): the variable is ;-separated
        return [str(v) for v in _items(value, ";") if v]
    if value is None:
        return None
    kind = _field_type(slot)
    if kind is bool and isinstance(value, str):
        if name == "kv_events_discover":  # on unless switched off, as its variable always read
            return value.strip().lower() not in ("0", "false", "no", "off")
        return value.strip().lower() in ("1", "true", "yes", "on")
    return kind(value)


def _worker(value: Any, env: Mapping[str, str]) -> WorkerSpec:
    if isinstance(value, WorkerSpec):
        return value
    if isinstance(value, dict):
        spec = parse_worker_arg(f"{value['name']}={value['url']}" if "name" in value else value["url"])
        api_key = value.get("api_key")
        if value.get("api_key_env"):
            api_key = env.get(value["api_key_env"])
        node, role = value.get("node"), value.get("role")
        return dataclasses.replace(
            spec, api_key=api_key, node=None if node is None else str(node),
            role=None if role is None else check_role(str(role)),
        )
    return parse_worker_arg(str(value))


def _nodes(value: Any) -> dict[str, str]:
    """Worker -> node from `NODE=W1,W2` items (flags; the variable ;-separated) or a YAML
    mapping `{NODE: [W1, W2]}` (or `{NODE: "W1,W2"}`)."""
    if isinstance(value, dict):
        groups = [(str(node), _items(names, ",")) for node, names in value.items()]
    else:
        groups = []
        for item in _items(value, ";"):
            node, sep, names = str(item).partition("=")
            if not sep or not node.strip():
                raise ValueError(f"expected NODE=W1,W2,...: {item!r}")
            groups.append((node.strip(), names.split(",")))
    out: dict[str, str] = {}
    for node, names in groups:
        for name in (str(n).strip() for n in names):
            if not name:
                continue
            if out.get(name, node) != node:
                raise ValueError(f"worker {name!r} is on two nodes: {out[name]!r} and {node!r}")
            out[name] = node
    return out


def _roles(value: Any) -> dict[str, str]:
    """Worker -> role from `NAME=ROLE` items (flags; the variable ,- or ;-separated) or a
    YAML mapping `{NAME: ROLE}`."""
    if isinstance(value, dict):
        pairs = [(str(name), str(role)) for name, role in value.items()]
    else:
        items = [value] if isinstance(value, str) else list(value)
        pairs = []
        for item in (p for raw in items for p in str(raw).replace(";", ",").split(",") if p.strip()):
            name, sep, role = item.partition("=")
            if not sep or not name.strip():
                raise ValueError(f"expected NAME=prefill|decode|both: {item!r}")
            pairs.append((name.strip(), role.strip()))
    return {name: check_role(role) for name, role in pairs}


def _from_yaml(path: str) -> dict[Slot, Any]:
    import yaml

    with open(path, encoding="utf-8") as fh:
        loaded = yaml.safe_load(fh) or {}
    if not isinstance(loaded, dict):
        raise SystemExit(f"kvroute: {path}: expected a mapping of settings")
    values: dict[Slot, Any] = {}
    unknown: list[str] = []
    for key, value in loaded.items():
        key = str(key).replace("-", "_")
        if key in SECTIONS and isinstance(value, dict):
            fields = {f.name for f in dataclasses.fields(SECTIONS[key])}
            for sub, item in value.items():
                sub = str(sub).replace("-", "_")
                if sub in fields:
                    values[(key, sub)] = item
                else:
                    unknown.append(f"{key}.{sub}")
        elif key in FLAT_KEYS:
            values[FLAT_KEYS[key]] = value
        else:
            unknown.append(key)
    if unknown:
        raise SystemExit(f"kvroute: unknown settings in {path}: {', '.join(sorted(unknown))}")
    return values


def _from_env(env: Mapping[str, str]) -> dict[Slot, Any]:
    values: dict[Slot, Any] = {}
    for name, slot in FLAT_KEYS.items():
        alias = (LIST_FLAGS.get(name) or ALIASES.get(name, "")).lstrip("-").replace("-", "_").upper()
        for env_name in (ENV_PREFIX + name.upper(), ENV_PREFIX + alias):
            if env_name != ENV_PREFIX and env_name in env:
                values[slot] = env[env_name]
    return values


_SAMPLER_RATIOS = {"always_on": 1.0, "always_off": 0.0, "parentbased_always_on": 1.0, "parentbased_always_off": 0.0}


def _from_otel(env: Mapping[str, str]) -> dict[Slot, Any]:
    """The standard OpenTelemetry variables the `tracing` section reads (below the
    KVROUTE_* ones): the traces endpoint (or the base endpoint, plus `/v1/traces` over
    http), the protocol, the sampler's ratio and the service name."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or env.get("OTEL_TRACES_EXPORTER") == "none":
        return {("tracing", "otlp_endpoint"): None}
    values: dict[Slot, Any] = {}
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol:
        values[("tracing", "otlp_protocol")] = protocol
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        values[("tracing", "otlp_endpoint")] = env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    elif base:
        values[("tracing", "otlp_endpoint")] = base if protocol == "grpc" else base.rstrip("/") + "/v1/traces"
    sampler = env.get("OTEL_TRACES_SAMPLER", "")
    if sampler in _SAMPLER_RATIOS:
        values[("tracing", "sample_ratio")] = _SAMPLER_RATIOS[sampler]
    elif env.get("OTEL_TRACES_SAMPLER_ARG"):
        values[("tracing", "sample_ratio")] = env["OTEL_TRACES_SAMPLER_ARG"]
    if env.get("OTEL_SERVICE_NAME"):
        values[("tracing", "service_name")] = env["OTEL_SERVICE_NAME"]
    return values


_FLAT_NAMES = {slot: name for name, slot in FLAT_KEYS.items()}


def _label(slot: Slot) -> str:
    """The setting's flat name (`section.field` for one only a YAML section sets), for messages."""
    return _FLAT_NAMES.get(slot) or f"{slot[0]}.{slot[1]}"


def _assemble(values: dict[Slot, Any], env: Mapping[str, str]) -> RouterConfig:
    if not values.get(("precise", "tokenizer")):
        # Precise mode off: its other settings are not read (a stray KVROUTE_BLOCK_SIZE in
        # a container's environment means nothing), only --kv-events, which then fails.
        values = {slot: v for slot, v in values.items() if slot[0] != "precise" or slot[1] == "kv_events"}
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for slot, value in values.items():
        try:
            coerced = _coerce(slot, value, env)
        except (ValueError, TypeError, KeyError) as exc:
            raise SystemExit(f"kvroute: bad setting {_label(slot)}: {exc}") from None
        section, name = slot
        (top if section is None else sections[section])[name] = coerced
    try:
        config = RouterConfig(**top, **{name: SECTIONS[name](**fields) for name, fields in sections.items()})
    except ValueError as exc:  # a section's own check (e.g. cost.learning on|off)
        raise SystemExit(f"kvroute: bad setting: {exc}") from None
    if config.routing.policy not in POLICIES:
        raise SystemExit(f"kvroute: unknown policy {config.routing.policy!r}")
    return config


def load_config(argv: list[str], environ: Mapping[str, str] | None = None, prog: str = "kvroute serve") -> RouterConfig:
    env = environment() if environ is None else environ
    args = vars(build_parser(prog).parse_args(argv))
    values: dict[Slot, Any] = {}
    config_path = args.pop("config", None) or env.get(ENV_PREFIX + "CONFIG")
    if config_path:
        values.update(_from_yaml(config_path))
    values.update(_from_otel(env))
    values.update(_from_env(env))
    values.update({FLAT_KEYS[name]: value for name, value in args.items()})
    return _assemble(values, env)


def flat_config(**settings: Any) -> RouterConfig:
    """The config these flat settings (YAML keys, `redis="redis://..."`, `kv_capacity_tokens=...`)
    describe, the rest defaults: for code that builds a router without a command line."""
    unknown = set(settings) - set(FLAT_KEYS)
    if unknown:
        raise TypeError(f"unknown settings: {', '.join(sorted(unknown))}")
    return _assemble({FLAT_KEYS[name]: value for name, value in settings.items()}, {})


def environment() -> dict[str, str]:
    """This process's environment, read once (the rest of the router gets this snapshot)."""
    return dict(os.environ)


# -- the config of --processes N children --------------------------------------------------
def config_to_json(config: RouterConfig) -> str:
    return orjson.dumps(dataclasses.asdict(config)).decode()


def config_from_json(raw: str) -> RouterConfig:
    """Exactly the config `config_to_json` was given (round trip)."""
    data = orjson.loads(raw)
    return RouterConfig(
        workers=[WorkerSpec(**w) for w in data.pop("workers")],
        discover=list(data.pop("discover")),
        nodes=dict(data.pop("nodes")),
        roles=dict(data.pop("roles")),
        **{name: SECTIONS[name](**fields) for name, fields in data.items()},
    )


def hand_to_children(config: RouterConfig) -> None:
    """Put `config` where `--processes N` children (which inherit the environment) find it."""
    os.environ[CHILD_CONFIG_ENV] = config_to_json(config)


def config_for_child() -> RouterConfig:
    """In a `--processes N` child: the parent's config."""
    return config_from_json(os.environ[CHILD_CONFIG_ENV])
