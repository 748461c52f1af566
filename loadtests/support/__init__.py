"""What every load-test package and the test suite share: starting child processes and
stopping them. `processes` runs each child in a process group of its own and stops them
all when the command ends or is signalled; `routerproc` starts `kvroute serve` on a free
loopback port (the tests' `router` fixture, the simulator's cluster, every benchmark);
`otlp` is an OTLP trace receiver on loopback (the tracing tests and the vLLM stage's
`tracing` phase); `extras` checks for the `bench` extra before a command starts anything.
"""
