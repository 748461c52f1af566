"""The simulated vLLM + LMCache fleet: workers that speak vLLM's OpenAI-compatible API, keep
a real paged prefix cache, batch continuously and charge each step an H200's time (derived
from `data/h200_kv_costs.json`), and the shared LMCache pool. Run as `kvroute sim-worker`,
`kvroute sim-pool` and `kvroute sim-cluster`; the tests, the benchmarks and the e2e drivers
start it through `cluster.SimCluster`. docs/simulator.md describes it.
"""
