"""Prefill/decode disaggregation without a network: the priced decision (`choose_pd`, a pure
function), the bodies P and D get (vLLM's NixlConnector contract), the usage rewrite, and
the roles' configuration."""

from __future__ import annotations

import orjson
import pytest

from cache_client.base import IndexView
from normalizer.prefix import PrefixChain
from router.config_loader import flat_config, load_config
from router.cost import CostModel
from router.policies.cache_aware import CacheAwarePolicy
from router.policies.disagg import (
    NIXL,
    PD,
    PD_LOCAL,
    SHARED_STORAGE,
    DisaggSettings,
    PdPricing,
    choose_pd,
    roles_split,
)
from router.proxy.disagg import (
    PREFILL_PARAMS,
    answer_params,
    decode_body,
    prefill_body,
    reported_cached,
    rewrite_usage,
)
from router.routing import RouteRequest, WorkerLoad

COST = CostModel()
BUDGET = PdPricing(itl_budget_s=0.05)
ROLES = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}


def chain(tokens: int, blocks: int = 8) -> PrefixChain:
    """A prompt of `tokens` in `blocks` equal keys."""
    step = tokens // blocks
    return PrefixChain(tuple(range(1, blocks + 1)), tuple(step * (i + 1) for i in range(blocks)), tokens)


def view(**depths: int) -> IndexView:
    return IndexView(depths)


def loads(**running: int) -> list[WorkerLoad]:
    return [WorkerLoad(name, inflight=running.get(name, 0)) for name in ROLES]


def decide(tokens: int, held: dict[str, int], running: dict[str, int], pricing: PdPricing = BUDGET) -> object:
    request = RouteRequest(chain(tokens))
    return choose_pd(CacheAwarePolicy(), request, view(**held), loads(**running), COST, ROLES, pricing)


def test_an_idle_decode_worker_prefills_locally_it_answers_sooner() -> None:
    d = decide(8000, {}, {})
    assert d.reason == PD_LOCAL and d.worker.startswith("d")
    assert d.pd.prefill_worker.startswith("p") and d.pd.local_ttft_s < d.pd.pd_ttft_s
    assert d.pd.running_decodes == 0


def test_a_busy_decode_worker_splits_a_long_prompt_beyond_the_itl_budget() -> None:
    d = decide(8000, {}, {"d0": 30, "d1": 30})
    assert d.reason == PD and d.pd.local_prefill_s > BUDGET.itl_budget_s
    assert d.pd.pull_tokens == 8000
    assert d.prefill_s == pytest.approx(d.pd.transfer_s + COST.step_s)  # D only reads and steps


def test_a_conversations_short_new_turn_stays_on_its_decode_worker() -> None:
    """D holds the conversation: its new part is a short local prefill within the budget,
    however busy D is; the same prompt unheld would be split."""
    held = decide(8000, {"d1": 7}, {"d0": 30, "d1": 30})
    assert held.worker == "d1" and held.reason == PD_LOCAL
    assert held.pd.local_prefill_s <= BUDGET.itl_budget_s
    assert decide(8000, {}, {"d0": 30, "d1": 30}, PdPricing(itl_budget_s=0.0)).reason == PD


def test_the_budget_is_in_inter_token_terms() -> None:
    d = decide(4000, {}, {"d0": 5, "d1": 5}, PdPricing(itl_budget_s=1.0))
    assert d.reason == PD_LOCAL  # 4k tokens' prefill (~90 ms) fits a 1 s stall budget
    assert decide(4000, {}, {"d0": 5, "d1": 5}, PdPricing(itl_budget_s=0.01)).reason == PD


def test_a_queue_on_the_decode_worker_makes_the_split_faster() -> None:
    busy = [WorkerLoad("p0"), WorkerLoad("p1"), WorkerLoad("d0", queued_prefill_s=2.0, inflight=1, prefilling=1),
            WorkerLoad("d1", queued_prefill_s=2.0, inflight=1, prefilling=1)]  # fmt: skip
    d = choose_pd(CacheAwarePolicy(), RouteRequest(chain(2000)), view(), busy, COST, ROLES, BUDGET)
    assert d.reason == PD and d.pd.pd_ttft_s < d.pd.local_ttft_s


def test_a_queued_prefill_worker_keeps_a_long_prompt_on_its_decode_worker() -> None:
    """The stall beyond the budget is priced, not forbidden: when P's queue costs more than
    the stall a local prefill adds to D's decodes, D prefills it."""
    ps = {"p0": 3.0, "p1": 3.0}
    lds = [WorkerLoad(n, inflight=4, queued_prefill_s=ps.get(n, 0.0), prefilling=3 if n in ps else 0) for n in ROLES]
    d = choose_pd(CacheAwarePolicy(), RouteRequest(chain(8000)), view(), lds, COST, ROLES, BUDGET)
    assert d.reason == PD_LOCAL and d.pd.local_stall_s > BUDGET.itl_budget_s
    assert d.pd.local_cost_s < d.pd.pd_cost_s and d.pd.pd_ttft_s > 3.0
    idle_p = [WorkerLoad(n, inflight=4) for n in ROLES]
    assert choose_pd(CacheAwarePolicy(), RouteRequest(chain(8000)), view(), idle_p, COST, ROLES, BUDGET).reason == PD
    hard = PdPricing(itl_budget_s=0.05, stall_weight=1e6)  # the budget as a hard limit: P's queue or not
    assert choose_pd(CacheAwarePolicy(), RouteRequest(chain(8000)), view(), lds, COST, ROLES, hard).reason == PD


def test_a_local_prefill_stalls_one_gap_per_chunk() -> None:
    pricing = PdPricing(itl_budget_s=0.05, chunk_tokens=4096)
    assert pricing.excess_stall_s(0.04, 4000) == 0.0  # one gap, within the budget
    assert pricing.excess_stall_s(0.2, 16_384) == pytest.approx(0.0)  # four gaps of 50 ms
    assert pricing.excess_stall_s(0.3, 16_384) == pytest.approx(4 * (0.075 - 0.05))
    assert PdPricing(itl_budget_s=0.05, chunk_tokens=1 << 20).excess_stall_s(0.3, 16_384) == pytest.approx(0.25)
    # The same 16k-token prompt, chunked finer on D, fits a budget it exceeds in one chunk.
    wide = decide(16_000, {}, {"d0": 30, "d1": 30}, PdPricing(itl_budget_s=0.2, chunk_tokens=1 << 20))
    fine = decide(16_000, {}, {"d0": 30, "d1": 30}, PdPricing(itl_budget_s=0.2, chunk_tokens=4096))
    assert wide.reason == PD and fine.reason == PD_LOCAL and fine.pd.local_excess_stall_s == 0.0


def test_always_splits_and_a_fleet_without_prefill_workers_never_does() -> None:
    assert decide(100, {}, {}, PdPricing(always=True)).reason == PD
    only_decode = {"d0": "decode", "d1": "decode", "b0": "both"}
    lds = [WorkerLoad(n) for n in only_decode]
    d = choose_pd(CacheAwarePolicy(), RouteRequest(chain(800)), view(), lds, COST, {"d0": "decode", "d1": "decode"}, PdPricing(always=True))
    assert d.pd.prefill_worker == "b0" or d.worker == "b0"


def test_mixed_fleets_roles_split() -> None:
    lds = [WorkerLoad(n) for n in ("p0", "d0", "b0")]
    decoders, prefillers = roles_split(lds, {"p0": "prefill", "d0": "decode"})
    assert [w.name for w in decoders] == ["d0", "b0"] and [w.name for w in prefillers] == ["p0", "b0"]
    only_p, _ = roles_split([WorkerLoad("p0")], {"p0": "prefill"})
    assert [w.name for w in only_p] == ["p0"]  # nothing else can serve: P serves whole requests


# -- the protocol's bodies -------------------------------------------------------------------------


def test_prefill_body_follows_vllms_proxy() -> None:
    chat = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 4,
            "max_tokens": 100, "max_completion_tokens": 100}  # fmt: skip
    out = prefill_body(chat, "chat")
    assert out["kv_transfer_params"] == PREFILL_PARAMS
    assert out["stream"] is False and out["max_tokens"] == 1 and out["max_completion_tokens"] == 1
    assert "stream_options" not in out and "min_tokens" not in out
    assert "max_completion_tokens" not in prefill_body({"model": "m", "prompt": "x"}, "completion")
    resp = prefill_body({"model": "m", "input": "x", "max_output_tokens": 9}, "responses")
    assert resp["max_output_tokens"] == 1 and resp["store"] is False
    assert chat["stream"] is True  # the client's body is left as it was


def test_decode_body_is_the_clients_with_ps_params() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "e", "remote_request_id": "r",
              "remote_host": "h", "remote_port": 1, "tp_size": 1}  # fmt: skip
    client = {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 50}
    assert decode_body(client, params) == {**client, "kv_transfer_params": params}
    assert answer_params({"kv_transfer_params": params}) == params
    assert answer_params({"kv_transfer_params": None}) is None and answer_params({}) is None


def test_a_shared_storage_prefill_asks_for_no_hold() -> None:
    """The connector stores every prompt's KV by its tokens: P gets no params to answer."""
    chat = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 100}
    out = prefill_body(chat, "chat", SHARED_STORAGE)
    assert "kv_transfer_params" not in out and "stream_options" not in out
    assert out["stream"] is False and out["max_tokens"] == 1
    assert prefill_body(chat, "chat", NIXL) == prefill_body(chat, "chat")


def test_usage_rewrite_in_every_apis_shape() -> None:
    chat = orjson.dumps({"usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 99}}, "t": 'say "cached_tokens":5'})
    assert orjson.loads(rewrite_usage(chat, 32))["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert orjson.loads(rewrite_usage(chat, 32))["t"] == 'say "cached_tokens":5'
    msg = b'event: message_start\ndata: {"message":{"usage":{"input_tokens":1,"output_tokens":0,"cache_read_input_tokens":99}}}\n\n'
    usage = orjson.loads(rewrite_usage(msg, 40).split(b"data: ")[1])["message"]["usage"]
    assert usage == {"input_tokens": 60, "output_tokens": 0, "cache_read_input_tokens": 40}
    assert reported_cached({"usage": {"input_tokens_details": {"cached_tokens": 7}}}) == 7
    assert reported_cached({"usage": {"cache_read_input_tokens": 3, "input_tokens": 5}}) == 3
    assert reported_cached({}) is None


# -- configuration -----------------------------------------------------------------------------


def test_roles_from_flags_environment_and_yaml(tmp_path) -> None:
    config = load_config(["--worker", "a=http://h:1", "--role", "a=prefill", "--role", "b=decode", "--pd-itl-budget-ms", "20"], {})
    assert config.roles == {"a": "prefill", "b": "decode"} and config.disagg.itl_budget_ms == 20
    assert load_config([], {"KVROUTE_ROLES": "a=prefill,b=both"}).roles == {"a": "prefill", "b": "both"}
    path = tmp_path / "k.yaml"
    path.write_text("workers: [{name: a, url: 'http://h:1', role: decode}]\nroles: {b: prefill}\ndisagg: {split: always}\n")
    config = load_config(["--config", str(path)], {})
    assert config.workers[0].role == "decode" and config.roles == {"b": "prefill"} and config.disagg.split == "always"
    assert flat_config(pd_split="always").disagg == DisaggSettings(split="always")
    for bad in (["--role", "a=gpu"], ["--role", "nameless"]):
        with pytest.raises(SystemExit):
            load_config(bad, {})


def test_the_pd_connector_from_flag_environment_and_yaml(tmp_path) -> None:
    assert load_config([], {}).disagg.connector == NIXL
    assert load_config(["--pd-connector", "shared-storage"], {}).disagg.connector == SHARED_STORAGE
    assert load_config([], {"KVROUTE_PD_CONNECTOR": "shared-storage"}).disagg.connector == SHARED_STORAGE
    path = tmp_path / "k.yaml"
    path.write_text("disagg: {connector: shared-storage}\n")
    assert load_config(["--config", str(path)], {}).disagg.connector == SHARED_STORAGE
    with pytest.raises(SystemExit):
        load_config(["--pd-connector", "lmcache"], {})
    with pytest.raises(SystemExit):
        load_config([], {"KVROUTE_PD_CONNECTOR": "nfs"})
    with pytest.raises(ValueError, match="pd_connector must be one of nixl, shared-storage, not 'nfs'"):
        DisaggSettings(connector="nfs")


def test_a_fleet_without_roles_is_aggregated() -> None:
    config = flat_config(workers=["a=http://h:1"])
    assert config.roles == {} and config.workers[0].role is None
