"""Every precise-mode setting in one typed object, and precise mode built from it.

`PreciseSettings` is the `precise` section of the router's config (flags, `KVROUTE_*`
variables and YAML keys like every other setting, router/config_loader.py);
`build_precise` checks it and builds the mode.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, get_args

from router.precise.events import PreciseMode
from router.precise.tokenizer import ModelTokenizer

if TYPE_CHECKING:
    from cache_client.kv_events import CpuMedium
    from router.chain import ChainBuilder

PRECISE_EXTRA_MODULES = ("tokenizers", "jinja2")
"""What `pip install 'kvroute[precise]'` brings (pyproject.toml), imported only in precise mode."""


@dataclass
class PreciseSettings:
    tokenizer: str | None = None
    """Model directory (`tokenizer.json` + `tokenizer_config.json`, or `chat_template.jinja`):
    turns precise mode on. None: precise mode off, the other settings unused."""
    block_size: int | None = None
    """vLLM block size. None: each worker's `vllm:cache_config_info` (`block_size`, or
    `hash_block_size` when set)."""
    hash_algo: str | None = None
    """`sha256` (vLLM's default) or `sha256_cbor`. None: the workers' `prefix_caching_hash_algo`."""
    hash_seed: str | None = None
    """Only if the workers run with `PYTHONHASHSEED` set: it replaces vLLM's `"vllm-none-hash"` seed."""
    kv_events: list[str] = field(default_factory=list)
    """Workers' KV-event publishers, `NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=T]` each."""
    kv_events_discover: bool = True
    """For workers without `kv_events`, ask `GET /kv_event_sources` (vLLM >= 0.32)."""
    kv_events_cpu: CpuMedium = "pool"
    """Where CPU-medium events go: `pool` (LMCache's shared pool), `worker` or `ignore`."""


def require_precise_extra() -> None:
    """Exit with the extra to install when precise mode's packages are missing (instead of a
    `ModuleNotFoundError` traceback from the first tokenizer or template loaded)."""
    missing = []
    for module in PRECISE_EXTRA_MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise SystemExit(
            f"kvroute: --tokenizer (precise mode) needs {' and '.join(missing)}, which are not installed: "
            "pip install 'kvroute[precise]'"
        )


def build_precise(settings: PreciseSettings, fallback: ChainBuilder | None = None) -> PreciseMode | None:
    """Precise mode as `settings` describe it, or None when they name no tokenizer.

    A setting that cannot work ends the router (SystemExit naming its flag) before anything
    starts, like `kvroute serve`'s own settings.
    """
    if not settings.tokenizer:
        if settings.kv_events:
            raise SystemExit("kvroute: --kv-events needs --tokenizer (precise mode)")
        return None
    require_precise_extra()
    from cache_client.kv_events import CpuMedium, parse_kv_events_arg
    from normalizer.vllm_hash import hash_function

    sources = [parse_kv_events_arg(a) for a in settings.kv_events]
    if settings.hash_algo is not None:
        try:
            hash_function(settings.hash_algo)
        except ValueError as exc:
            raise SystemExit(f"kvroute: {exc}") from None
    cpu = settings.kv_events_cpu
    if cpu not in get_args(CpuMedium):
        raise SystemExit(f"kvroute: --kv-events-cpu must be pool, worker or ignore, not {cpu!r}")
    return PreciseMode(
        ModelTokenizer.from_dir(settings.tokenizer),
        block_size=settings.block_size,
        hash_algo=settings.hash_algo,
        hash_seed=settings.hash_seed,
        sources=sources,
        discover=settings.kv_events_discover,
        cpu_medium=cpu,
        fallback=fallback,
    )
