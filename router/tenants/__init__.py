"""Tenants: many customers on one fleet.

`model` holds the pure data every tenant feature reads: who a tenant is, which cache scope
its prompts share, its weight in the fair-share queue and its limits. The file format and
its loader, the cache salt, the limiter and the fair-share queue live in modules of their
own beside it.
"""
