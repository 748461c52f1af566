"""`kvroute bench --roles`: a prefill/decode-disaggregated simulated fleet, kvroute told the
roles, `NAME+agg` on the same workers aggregated, vllm-router in its prefill/decode mode,
and the decode side's figures (inter-token latency from the client, decode tokens/s,
splits)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import orjson
import pytest

from loadtests.benchmark.bench import (
    RunSetup,
    _kvroute_args,
    agg_comparison,
    build_parser,
    check_roles,
    decode_rates,
    disagg_summary,
    fleet_label,
    parse_entries,
)
from loadtests.benchmark.harness import RequestRecord, RunOutcome, _stream_one
from loadtests.benchmark.peers import parse_peer, peer_command
from loadtests.sim.costs import DEFAULT_PROFILE
from router.proxy.upstream import RawUpstreamClient
from tests.support.upstream import RecordingUpstream, UpstreamBehaviour


def _setup(roles: list[str] | None, link: float | None = None) -> RunSetup:
    return RunSetup(4, DEFAULT_PROFILE, 1.0, 1000, 5000, Path("."), roles=roles, kv_link_gbps=link)


def test_agg_entries_run_on_the_same_workers_aggregated() -> None:
    entries = {e.key: e for e in parse_entries("cache_aware,cache_aware+agg,random+pool+agg", "vllm-router/pd")}
    assert set(entries) == {"cache_aware", "cache_aware+agg", "random+pool+agg", "vllm-router/pd"}
    assert entries["cache_aware+agg"].aggregated and entries["cache_aware+agg"].policy == "cache_aware"
    assert entries["random+pool+agg"].pool and entries["random+pool+agg"].policy == "random"
    assert (entries["vllm-router/pd"].peer, entries["vllm-router/pd"].policy) == ("vllm-router", "pd")
    setup = _setup(["prefill", "decode", "decode", "decode"], link=100.0)
    told = _kvroute_args(setup, entries["cache_aware"])
    assert " ".join(told).count("--role") == 4 and "w0=prefill" in told and "w3=decode" in told
    assert told[told.index("--pd-link-gbps") + 1] == "100.0"
    assert "--role" not in _kvroute_args(setup, entries["cache_aware+agg"])
    assert setup.entry_roles(entries["cache_aware+agg"]) == {f"w{i}": "both" for i in range(4)}
    assert "--role" not in _kvroute_args(_setup(None), entries["cache_aware"])  # no --roles: as before


def test_pd_decision_variants_run_as_their_own_entries() -> None:
    """`NAME+itlN`, `NAME+stallN` and `NAME+always` give kvroute that inter-token budget, that
    price of a stall, or every request split."""
    names = "cache_aware,cache_aware+itl20,cache_aware+always,cache_aware+itl7.5+agg,cache_aware+itl10+stall2.5"
    entries = {e.key: e for e in parse_entries(names, "")}
    assert set(entries) == set(names.split(","))
    both = _kvroute_args(_setup(["prefill", "decode"], link=100.0), entries["cache_aware+itl10+stall2.5"])
    assert both[both.index("--pd-itl-budget-ms") + 1] == "10" and both[both.index("--pd-stall-weight") + 1] == "2.5"
    setup = _setup(["prefill", "decode", "decode", "decode"], link=100.0)
    itl = _kvroute_args(setup, entries["cache_aware+itl20"])
    assert itl[itl.index("--pd-itl-budget-ms") + 1] == "20" and "--pd-split" not in itl
    always = _kvroute_args(setup, entries["cache_aware+always"])
    assert always[always.index("--pd-split") + 1] == "always" and "--pd-itl-budget-ms" not in always
    plain = _kvroute_args(setup, entries["cache_aware"])
    assert "--pd-split" not in plain and "--pd-itl-budget-ms" not in plain
    assert "--pd-itl-budget-ms" not in _kvroute_args(setup, entries["cache_aware+itl7.5+agg"])  # aggregated: no roles


def test_pd_is_asked_for_by_name_only() -> None:
    assert [p for _, p in parse_peer("vllm-router")] == ["cache_aware", "consistent_hash"]
    assert parse_peer("vllm-router/pd") == [("vllm-router", "pd")]
    with pytest.raises(ValueError):
        parse_peer("sglang-router/pd")


def test_the_pd_peer_gets_each_worker_by_role() -> None:
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]
    cmd = peer_command("vllm-router", "pd", Path("/x/vllm-router"), urls, 9000, 9001, ["prefill", "decode", "decode"])
    assert "--vllm-pd-disaggregation" in cmd and "--worker-urls" not in cmd
    assert cmd[cmd.index("--kv-connector") + 1] == "nixl"
    assert cmd[cmd.index("--prefill") + 1] == urls[0]
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--decode"] == urls[1:]
    with pytest.raises(ValueError):
        peer_command("vllm-router", "pd", Path("/x"), urls, 9000, 9001, ["prefill", "decode", "both"])


@pytest.mark.parametrize(
    "argv",
    [
        ["--policies", "cache_aware+agg"],  # +agg without --roles
        ["--policies", "", "--peers", "vllm-router/pd"],  # pd without --roles
        ["--roles", "prefill:1,both:3", "--policies", "", "--peers", "vllm-router/pd"],
        ["--roles", "prefill:1,decode:3", "--policies", "", "--peers", "vllm-router/pd+agg"],
        ["--roles", "prefill:1,decode:2"],  # 3 roles for 4 workers
        ["--roles", "prefill:1,decode:3", "--via", "envoy"],
        ["--kv-link-gbps", "100"],
    ],
)
def test_roles_and_what_needs_them_are_checked_before_anything_starts(argv: list[str]) -> None:
    args = build_parser().parse_args(["--workers", "4", "--out", "x", *argv])
    with pytest.raises(ValueError):
        check_roles(args, parse_entries(args.policies, args.peers))


def test_decode_figures_come_from_the_gaps_and_the_workers_counters() -> None:
    def scrape(sim_s: float, tokens: float, pulls: float = 0.0) -> dict[str, float]:
        return {"sim:simulated_seconds": sim_s, "vllm:generation_tokens_total": tokens, "kvroute_sim:nixl_pulls_total": pulls}

    before = {"w0": scrape(10, 5), "w1": scrape(10, 100)}
    after = {"w0": scrape(30, 9), "w1": scrape(30, 2100, pulls=3)}
    assert decode_rates(before, after) == {"w0": pytest.approx(0.2), "w1": pytest.approx(100.0)}
    records = [RequestRecord(0, t, "chat", True, 0.0, 200, 0.1, 1.0, 10) for t in range(4)]
    outcome = RunOutcome(records, 1, 1, 0, 1.0, 1.0, 1.0, False, itl_gaps_s=[0.01] * 98 + [0.5, 0.9])
    delta = {"vllm:inter_token_latency_seconds_sum": 2.0, "vllm:inter_token_latency_seconds_count": 100.0,
             "kvroute_sim:nixl_pulls_total": 3.0}  # fmt: skip
    s = disagg_summary(outcome, delta, before, after, {"w0": "prefill", "w1": "decode"})
    assert s["itl_p50_s"] == 0.01 and s["itl_p99_s"] == 0.5 and s["itl_gaps"] == 100
    assert s["itl_source"].startswith("client")
    assert s["worker_itl_mean_s"] == pytest.approx(0.02)
    assert s["decode_tok_per_s"] == pytest.approx(100.0)  # the prefill worker's tokens are not decode
    assert s["pd"]["split_share"] == pytest.approx(0.75)
    assert "itl_gaps_s" not in outcome.to_dict()  # results.json's `run` section is unchanged


def test_each_router_is_compared_with_itself_on_the_aggregated_fleet() -> None:
    split = {"ttft_mean_s": 0.2, "ttft_p99_s": 1.0, "itl_mean_s": 0.01, "itl_p99_s": 0.02}
    agg = {"ttft_mean_s": 0.4, "ttft_p99_s": 1.0, "itl_mean_s": 0.02, "itl_p99_s": 0.08}
    out = agg_comparison({"cache_aware": split, "cache_aware+agg": agg, "random": split})
    assert out == {"cache_aware_over_agg_ttft_mean": 0.5, "cache_aware_over_agg_ttft_p99": 1.0,
                   "cache_aware_over_agg_itl_mean": 0.5, "cache_aware_over_agg_itl_p99": 0.25}  # fmt: skip


def test_fleet_labels() -> None:
    assert fleet_label({"w0": "prefill", "w1": "prefill", "w2": "decode"}) == "2P+1D"
    assert fleet_label({"w0": "both", "w1": "both"}) == "2 aggregated"
    assert fleet_label({"w0": "prefill", "w1": "decode", "w2": "both"}) == "1P+1D+1B"


async def _stream(upstream: RecordingUpstream, gaps: list[float]) -> RequestRecord:
    import asyncio

    record = RequestRecord(0, 0, "chat", True, 0.0)
    client = RawUpstreamClient(connect_timeout_s=5.0)
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    try:
        t0 = asyncio.get_running_loop().time()
        await _stream_one(client, upstream.url, "/v1/chat/completions", body, [(b"content-type", b"application/json")],
                          record, t0, 1.0, [float("inf")], gaps=gaps)  # fmt: skip
    finally:
        await client.aclose()
    return record


async def test_the_client_records_the_gaps_between_token_events_of_a_stream_that_ended() -> None:
    with RecordingUpstream(behaviour=UpstreamBehaviour(chunks=5, chunk_delay_s=0.02)) as upstream:
        gaps: list[float] = []
        record = await _stream(upstream, gaps)
        assert record.error is None and record.decode_s is not None
        # One gap per token event after the first (fewer only if the socket coalesced events).
        assert 1 <= len(gaps) <= 4
        assert sum(gaps) == pytest.approx(record.decode_s)
        upstream.behaviour.break_after_chunks = 3
        broken: list[float] = []
        record = await _stream(upstream, broken)
        assert record.error is not None and broken == []


# -- a tiny --roles run end to end ------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench-roles")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli_run(out)
    assert code == 0
    return json.loads((out / "results.json").read_text()), buf.getvalue()


def cli_run(out: Path) -> int:
    from loadtests.benchmark.bench import cli

    return cli(
        [
            "--scenario", "seed", "--workers", "4", "--roles", "prefill:1,decode:3",
            "--policies", "cache_aware,cache_aware+agg", "--peers", "vllm-router/pd",
            "--time-scale", "0.2", "--warmup", "12", "--window", "24", "--seed", "3", "--out", str(out),
        ]
    )  # fmt: skip


@pytest.mark.slow
def test_every_router_reports_the_decode_side(run: tuple[dict, str]) -> None:
    results, stdout = run
    assert not results["failed"], results["failed"]
    assert results["config"]["roles"] == ["prefill", "decode", "decode", "decode"]
    assert set(results["routers"]) == {"cache_aware", "cache_aware+agg", "vllm-router/pd"}
    for key, r in results["routers"].items():
        assert r["requests_measured"] > 0 and r["requests_failed"] == 0, key
        for field in ("ttft_mean_s", "ttft_p99_s", "itl_mean_s", "itl_p99_s", "worker_itl_mean_s", "decode_tok_per_s"):
            assert r[field] is not None and r[field] > 0, (key, field)
        assert r["itl_p50_s"] <= r["itl_p99_s"] and r["itl_gaps"] > 0
        assert set(r["decode_tok_per_s_by_worker"]) == {"w0", "w1", "w2", "w3"}
    lines = stdout.strip().splitlines()
    assert lines[0] == "## Disaggregated fleet" and any(line.startswith("| router | fleet |") for line in lines)
    assert json.loads(lines[-1])["routers"]["vllm-router/pd"]["itl_p99_s"] > 0  # the summary stays last


@pytest.mark.slow
def test_the_disaggregated_fleet_splits_and_the_aggregated_one_does_not(run: tuple[dict, str]) -> None:
    routers = run[0]["routers"]
    kv, agg, peer = routers["cache_aware"], routers["cache_aware+agg"], routers["vllm-router/pd"]
    assert kv["roles"]["w0"] == "prefill" and set(agg["roles"].values()) == {"both"}
    # kvroute split some requests through the prefill worker; the decode workers pulled their KV.
    assert kv["route_reasons"].get("pd", 0) > 0 and kv["pd"]["pulls"] > 0
    # Its local prefills on decode workers are the decode workers' own (sent without params).
    assert kv["pd"]["decode_local_prefills"] == kv["route_reasons"].get("pd_local", 0)
    assert kv["requests_per_worker"].get("w0", 0) == 0  # answers come from decode workers
    assert agg["pd"]["pulls"] == 0 and not any(r.startswith("pd") for r in agg["route_reasons"])
    assert run[0]["comparison"]["cache_aware_over_agg_itl_p99"] > 0
    # vllm-router in its prefill/decode mode served every request through P then D.
    assert peer["pd"]["pulls"] > 0 and peer["pd"]["decode_local_prefills"] == 0
