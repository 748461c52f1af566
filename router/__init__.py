"""kvroute: a KV-cache-aware, OpenAI-compatible load balancer for vLLM fleets."""

__version__ = "0.1.0"
