"""Simulated vLLM + LMCache cluster, workload generators and benchmarks."""
