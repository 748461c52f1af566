"""End-to-end drivers: each starts a whole stack on loopback (routers, workers, Redis) and
drives traffic through it. `demo` is `kvroute demo` (random against cache_aware TTFT);
`faults` and `soak` (`python -m loadtests.e2e.faults` / `.soak`, docs/reliability.md) kill
workers and abandon requests under load on the simulator; `replicas` starts throwaway Redis
servers, Redis Clusters and router replicas for the Redis tests and the measurements;
`vllm` runs the router against real vLLM CPU workers (the CI's vLLM stage and the tenant
and agent runs).
"""
