"""An independent client: GuideLLM drives the simulated cluster through kvroute.

Our bench client (`loadtests.benchmark.harness`) could share a blind spot with the router it
measures, so this recipe reproduces the `seed` scenario's shape with GuideLLM
(vLLM's load generator, PyPI `guidellm`), whose own synthetic multi-turn data, scheduler
and statistics are independent of ours. See docs/guidellm.md.

* GuideLLM is installed on first use into its own venv under `~/.cache/kvroute/guidellm`
  (`KVROUTE_GUIDELLM_DIR` moves it), pinned.
* It needs a Hugging Face tokenizer to size its synthetic prompts; none can be downloaded
  here, so one is trained locally with `tokenizers` (byte-level BPE on the same Faker text
  GuideLLM generates), choosing the vocabulary size whose tokens average closest to 4
  bytes: the simulator counts one token per 4 bytes, so GuideLLM's prompt sizes and the
  workers' token counts agree to a few percent.
* The GuideLLM scenario mirrors `seed` from its reference sample: `turns` = requests per
  session, `prefix_tokens` × `prefix_count` = each group's tools + system prompt × the
  number of groups, `prompt_tokens` = new tokens a turn adds (tool results),
  `first_prompt_tokens` = the first user message, `output_tokens` = mean generation,
  `delay` = mean think time, Poisson arrivals of conversations at the scenario's rate.
* It runs once per policy (`random` without the pool, `cache_aware` with it, as in the
  bench), each on a fresh cluster, and reports GuideLLM's own TTFT / ITL / throughput
  figures converted to simulated seconds (wall ÷ time scale), plus per-turn TTFT.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from loadtests.benchmark.workload import (
    MODEL,
    REFERENCE_SEED,
    REFERENCE_SESSIONS,
    SCENARIOS,
    derive_rates,
    make_group,
    make_session,
    session_tokens,
)
from loadtests.sim.costs import DEFAULT_PROFILE, build_cost_model
from loadtests.sim.pool import DEFAULT_CAPACITY_TOKENS as POOL_CAPACITY_TOKENS
from loadtests.support.processes import run, stop_children_on_signals
from loadtests.support.routerproc import RouterProcess

GUIDELLM_VERSION = "0.8.1"
TARGET_BYTES_PER_TOKEN = 4.0
VOCAB_SIZES = (1400, 1600, 1800, 2000, 2200, 2600)

# Runs inside GuideLLM's venv (it has tokenizers and Faker). Trains byte-level BPE on Faker
# text and keeps the vocabulary whose tokens average closest to the simulator's 4 bytes.
_TRAIN_TOKENIZER = r"""
import json, sys
from faker import Faker
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

out, target, sizes = sys.argv[1], float(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]
fake = Faker()
fake.seed_instance(20240601)
corpus = [fake.text(max_nb_chars=2000) for _ in range(800)]
held_out = [fake.text(max_nb_chars=2000) for _ in range(100)]
best = None
for size in sizes:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    ratio = sum(len(t.encode()) for t in held_out) / sum(len(tok.encode(t).ids) for t in held_out)
    if best is None or abs(ratio - target) < abs(best[1] - target):
        best = (size, ratio, tok)
size, ratio, tok = best
tok.save(f"{out}/tokenizer.json")
with open(f"{out}/tokenizer_config.json", "w") as fh:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 10**7,
               "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}, fh)
with open(f"{out}/special_tokens_map.json", "w") as fh:
    json.dump({"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}, fh)
print(json.dumps({"vocab_size": size, "bytes_per_token": ratio}))
"""


def guidellm_dir() -> Path:
    return Path(os.environ.get("KVROUTE_GUIDELLM_DIR", "~/.cache/kvroute/guidellm")).expanduser()


def ensure_guidellm() -> Path:
    """The venv's guidellm executable, installing it the first time."""
    venv = guidellm_dir()
    exe = venv / "bin" / "guidellm"
    marker = venv / f".installed-guidellm-{GUIDELLM_VERSION}"
    if exe.exists() and marker.exists():
        return exe
    venv.parent.mkdir(parents=True, exist_ok=True)
    for cmd in (
        [sys.executable, "-m", "venv", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         f"guidellm=={GUIDELLM_VERSION}"],
    ):  # fmt: skip
        done = run(cmd, 1800, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"installing guidellm failed: {done.stderr[-2000:]}")
    marker.write_text(GUIDELLM_VERSION)
    return exe


def ensure_tokenizer() -> tuple[Path, dict[str, Any]]:
    """A locally trained tokenizer directory AutoTokenizer can load, and its statistics."""
    exe = ensure_guidellm()
    path = guidellm_dir() / "tokenizer-4bytes"
    info_file = path / "kvroute-tokenizer.json"
    if info_file.exists() and (path / "tokenizer.json").exists():
        return path, json.loads(info_file.read_text())
    path.mkdir(parents=True, exist_ok=True)
    sizes = ",".join(str(s) for s in VOCAB_SIZES)
    done = run(
        [str(exe.parent / "python"), "-c", _TRAIN_TOKENIZER, str(path), str(TARGET_BYTES_PER_TOKEN), sizes],
        600, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"training the tokenizer failed: {done.stderr[-2000:]}")
    info = json.loads(done.stdout.strip().splitlines()[-1])
    info_file.write_text(json.dumps(info))
    return path, info


def seed_shape(workers: int, profile: str = DEFAULT_PROFILE) -> dict[str, Any]:
    """The `seed` scenario's mean shape, from the same reference sample the bench derives
    its rate from."""
    spec = SCENARIOS["seed"]
    rates = derive_rates(spec, workers, profile)
    groups = {g: make_group(REFERENCE_SEED, spec, g) for g in range(spec.groups)}
    shared, first_new, later_new, outputs, thinks, turns = [], [], [], [], [], []
    for i in range(REFERENCE_SESSIONS):
        s = make_session(REFERENCE_SEED, spec, i)
        toks = session_tokens(s, groups[s.group] if s.group is not None else None)
        shared.append(toks.shared)
        first_new.append(toks.prompts[0] - toks.shared)
        for k in range(1, len(toks.prompts)):
            later_new.append(toks.prompts[k] - toks.prompts[k - 1] - toks.outputs[k - 1])
        outputs.extend(toks.outputs)
        thinks.extend(t.think_s for t in s.turns[1:])
        turns.append(len(s.turns))

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    return {
        "turns": round(mean(turns)),
        "prefix_tokens": round(mean(shared)),
        "prefix_count": spec.groups,
        "first_prompt_tokens": round(mean(first_new)),
        "prompt_tokens": round(mean(later_new)),
        "output_tokens": round(mean(outputs)),
        "delay_s": mean(thinks),
        "sessions_per_s": rates.arrival_rate_per_s,
    }


def guidellm_scenario(target: str, shape: dict[str, Any], time_scale: float, duration_s: float, seed: int) -> dict:
    """A GuideLLM scenario file (`guidellm run --scenario FILE`), times in wall seconds."""
    return {
        "spec": {
            "backend": {"kind": "openai_http", "target": target, "model": MODEL, "request_format": "/v1/chat/completions"},
            "profile": {"kind": "poisson", "rate": [shape["sessions_per_s"] / time_scale]},
            "data": [
                {
                    "kind": "synthetic_text",
                    "turns": shape["turns"],
                    "prefix_tokens": shape["prefix_tokens"],
                    "prefix_count": shape["prefix_count"],
                    "first_prompt_tokens": shape["first_prompt_tokens"],
                    "prompt_tokens": shape["prompt_tokens"],
                    "output_tokens": shape["output_tokens"],
                    "delay": shape["delay_s"] * time_scale,
                }
            ],
            "constraints": [{"kind": "max_duration", "seconds": duration_s * time_scale}],
            "seed": {"kind": "static", "value": seed},
        }
    }


def _dig(obj: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return obj


def summarize_report(report: dict[str, Any], time_scale: float) -> dict[str, Any]:
    """GuideLLM's own statistics of the (single) benchmark, in simulated seconds."""
    bench = report["benchmarks"][0]
    metrics = bench.get("metrics", bench)

    def stat(name: str, field: str, scale: float) -> float | None:
        dist = _dig(metrics, name, "successful")
        if dist is None:
            return None
        value = dist.get(field) if field in dist else _dig(dist, "percentiles", field)
        return None if value is None else value * scale

    ms = 1e-3 / time_scale
    totals = metrics.get("request_totals") or {}
    out: dict[str, Any] = {
        "requests_successful": totals.get("successful"),
        "requests_errored": totals.get("errored"),
        "ttft_mean_s": stat("time_to_first_token_ms", "mean", ms),
        "ttft_p50_s": stat("time_to_first_token_ms", "median", ms),
        "ttft_p99_s": stat("time_to_first_token_ms", "p99", ms),
        "itl_mean_s": stat("inter_token_latency_ms", "mean", ms),
        "output_tok_per_s": stat("output_tokens_per_second", "mean", time_scale),
        "prompt_tokens_mean": stat("prompt_token_count", "mean", 1.0),
    }
    turns = metrics.get("turns") or bench.get("turns")
    if isinstance(turns, list | dict):
        per_turn = {}
        items = turns.items() if isinstance(turns, dict) else enumerate(turns)
        for key, t in items:
            ttft = _dig(t, "time_to_first_token_ms", "successful")
            if ttft:
                turn = t.get("turn_index", key) if isinstance(t, dict) else key
                per_turn[str(turn)] = {
                    "n": ttft.get("count"),
                    "ttft_mean_s": (ttft.get("mean") or 0) * ms,
                    "ttft_p99_s": (_dig(ttft, "percentiles", "p99") or 0) * ms,
                }
        out["ttft_by_turn"] = per_turn
    return out


def run_recipe(
    out_dir: Path,
    workers: int = 8,
    time_scale: float = 1.0,
    profile: str = DEFAULT_PROFILE,
    seed: int = 1,
    policies: tuple[str, ...] = ("random", "cache_aware"),
    duration_s: float = 90.0,
) -> dict[str, Any]:
    from loadtests.sim.cluster import SimCluster

    out_dir.mkdir(parents=True, exist_ok=True)
    exe = ensure_guidellm()
    tokenizer, tok_info = ensure_tokenizer()
    shape = seed_shape(workers, profile)
    capacity = build_cost_model(profile).default_capacity_tokens
    results: dict[str, Any] = {"shape": shape, "tokenizer": tok_info, "time_scale": time_scale, "policies": {}}
    for policy in policies:
        pool = policy != "random"
        with SimCluster(workers=workers, time_scale=time_scale, profile=profile, kv_capacity_tokens=capacity, pool=pool) as cluster:
            args = ["--kv-capacity-tokens", str(capacity), "--pool-capacity-tokens", str(POOL_CAPACITY_TOKENS if pool else 0)]
            with RouterProcess(cluster.worker_urls, policy, args, log_path=str(out_dir / f"{policy}.router.log")) as router:
                scenario = guidellm_scenario(router.url, shape, time_scale, duration_s, seed)
                scenario_file = out_dir / f"{policy}.scenario.json"
                scenario_file.write_text(json.dumps(scenario, indent=1))
                report_file = out_dir / f"{policy}.guidellm.json"
                cmd = [
                    str(exe), "run", "--scenario", str(scenario_file),
                    "--tokenizer", f"kind=hf_auto,model={tokenizer}",
                    "--output", f"kind=json,path={report_file}",
                    "--disable-console-interactive",
                ]  # fmt: skip
                env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NO_PROXY": "127.0.0.1,localhost"}
                t0 = time.monotonic()
                with (out_dir / f"{policy}.guidellm.log").open("w") as log:
                    done = run(cmd, duration_s * time_scale + 900, env=env, stdout=log, stderr=subprocess.STDOUT)
                wall = time.monotonic() - t0
                if done.returncode != 0 or not report_file.exists():
                    results["policies"][policy] = {"error": f"guidellm exited {done.returncode}; see {policy}.guidellm.log"}
                    continue
                summary = summarize_report(json.loads(report_file.read_text()), time_scale)
                summary["wall_s"] = wall
                results["policies"][policy] = summary
    return results


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.benchmark.guidellm_recipe", description="GuideLLM against the simulated cluster")
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--profile", default=DEFAULT_PROFILE)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--duration", type=float, default=90.0, help="simulated seconds per policy")
    p.add_argument("--policies", default="random,cache_aware")
    args = p.parse_args(argv)
    with stop_children_on_signals():
        results = run_recipe(
            Path(args.out), args.workers, args.time_scale, args.profile, args.seed,
            tuple(x for x in args.policies.split(",") if x), args.duration,
        )  # fmt: skip
    (Path(args.out) / "guidellm_results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results["policies"].items()}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
