"""The benchmark harness: `kvroute bench` (`bench`: routing policies and peer routers on
multi-turn agent workloads or a request trace, through the streaming client and monitors
of `harness`) and `kvroute bench-proxy` (`bench_proxy`: the router's own overhead, with
`fast_upstream` and `loadgen`), with what they need: workloads (`workload`, `random_lb`,
`screens`, `agent_wire`), traces (`traces`, `trace_replay`), learned costs
(`cost_learning`), peer routers (`peers`), Envoy in front of `kvroute epp` (`envoy`, also
`python -m loadtests.benchmark.envoy`), GuideLLM as an independent client
(`guidellm_recipe`) and plots. Run by hand and by tests/bench; docs/benchmark.md and
docs/performance.md quote its results.
"""
