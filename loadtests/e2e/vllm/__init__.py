"""kvroute against real vLLM CPU workers and a real LMCache pool, on a tiny test model.
`ci.sh` is the CI's last stage (called by scripts/test): `setup_env.sh` builds or reuses
the vLLM venv and the models under ~/.cache/kvroute, then `run_e2e` runs its phases (precise
mode's exactness, reuse, nodes, VLM, tracing, P/D), each a count of tokens checked. By hand:
`tenants` (tenant cache isolation, docs/tenants.md), `agents` (the agent SDKs, a script, not
CI), `cost_check` (the router's learned prefill cost against the engine's) and `cases` / `capture_hashes`, which
capture the fixtures tests/precise compares against. docs/precise.md describes the stage.
"""
