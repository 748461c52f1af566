"""The shared system Redis the `redis`-marked tests use, and removing a test's keys from it."""

from __future__ import annotations

import redis

from cache_client.redis_index import parse_redis_url

SYSTEM_REDIS = "redis://127.0.0.1:6379/0"


def delete_prefix(url: str, tag: str) -> None:
    settings_ = parse_redis_url(url)
    if settings_.cluster:
        client: redis.RedisCluster | redis.Redis = redis.RedisCluster(
            startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in settings_.nodes]
        )
    else:
        client = redis.Redis.from_url(settings_.url)
    with client:
        # Braces are not glob characters in Redis patterns: the tag matches literally.
        for key in client.scan_iter(match=tag + ":*", count=1000):
            client.delete(key)
