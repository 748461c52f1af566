"""One-off measurements whose JSON the docs quote, each run by hand as `python -m
loadtests.measure.NAME` when a doc's numbers are refreshed: `bench_index` and
`bench_event_writers` (the Redis index, docs/redis.md), `tenant_limits` and `tenant_timing`
(tenant limits across replicas and the timing side channel, docs/tenants.md),
`tier_eviction` and `affinity` (docs/benchmark.md). The tests run short versions of some
of them (tests/bench, tests/tenants, tests/router).
"""
