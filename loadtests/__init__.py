"""Everything that exercises kvroute without a GPU fleet, one package per concern.

`support` starts and stops the processes every other package and the test suite share (a
`kvroute serve` on a free port, child process groups, an OTLP receiver); `sim` is the
simulated vLLM + LMCache fleet (`kvroute sim-worker`, `sim-pool`, `sim-cluster`);
`benchmark` is the harness behind `kvroute bench` and `kvroute bench-proxy`; `e2e` drives
whole stacks end to end (`kvroute demo`, faults, soak, and `e2e.vllm` on
real vLLM, the CI's last stage); `measure` holds the one-off measurements whose numbers
the docs quote, each a `python -m loadtests.measure.NAME` command. Imports point one way,
support <- sim <- benchmark <- e2e <- measure, but for `benchmark.envoy`'s sigkill run,
which borrows `e2e.faults`' client and restartable worker.
"""
