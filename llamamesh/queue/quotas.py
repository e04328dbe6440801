"""Every tenant's budgets in Redis, shared by all gateways (``RedisQuotas``, the ``Quotas`` protocol
on Redis): requests per second, tokens per minute, concurrent streams, and the items and bytes of
batches. Each check is one Lua script on the tenant's keys (one hash tag, ``{t:<tenant>}``), so N
gateways enforce one budget and two racing requests cannot both take its last unit. The limits:
docs/api.md ("Tenants file limits").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis

from llamamesh.errors import AlreadyExists, RateLimited
from llamamesh.queue.gateway_stores import Quotas
from llamamesh.queue.keys import STREAM_LEASE_MS, UNSTORED_GRACE_S, Keys, Retention
from llamamesh.queue.redisio import call_scripts, unreachable
from llamamesh.queue.scripts import register
from llamamesh.settings import LimitsSettings
from llamamesh.types import public_id

# Also importable from here (the protocol and the constants are gateway_stores.py's and keys.py's).
__all__ = ["STREAM_LEASE_MS", "UNSTORED_GRACE_S", "Quotas", "RedisQuotas"]

# What a refused batch is told: items free as batches end (the sweep gives them back every few
# seconds); bytes only when finished batches' results expire.
BATCH_ITEMS_RETRY_S = 5.0
BATCH_BYTES_RETRY_S = 60.0

_ENDED = {b"completed", b"failed", b"expired", b"cancelled"}


class RedisQuotas:
    """The budgets on Redis. Time is Redis's own (``TIME``), not each gateway's clock. A limit of 0 is
    no limit; a check with every limit at 0 costs no round trip. Over a limit: RateLimited with the
    seconds until it would pass (RetryInfo). Redis errors: QueueUnavailable."""

    def __init__(self, client: aioredis.Redis, keys: Keys, retention: Retention | None = None) -> None:
        self._r = client
        self.keys = keys
        self.retention = retention or Retention()
        self._admit = register(client, "admit")
        self._spend = register(client, "spend_tokens")
        self._open = register(client, "open_stream")
        self._renew = register(client, "renew_streams")
        self._reserve = register(client, "reserve_batch")
        self._give_back = register(client, "give_back_quota")

    async def admit(self, tenant: str, limits: LimitsSettings, reserve: int = 0) -> None:
        """Requests per second: a token bucket (``requests_per_s``, ``burst``). Tokens per minute: a
        bucket that refills at ``tokens_per_min`` a minute; a request is admitted while it is above
        zero, and takes ``reserve`` tokens (the most it may generate) out of it at once, so that a
        burst of requests cannot spend many minutes' worth; ``spend`` settles the difference."""
        rps, tpm = limits.requests_per_s, limits.tokens_per_min
        if rps <= 0 and tpm <= 0:
            return
        burst = limits.burst or max(1, math.ceil(rps))
        with unreachable():
            got: Any = await self._admit(
                keys=[self.keys.tenant_rate(tenant)],
                args=[rps, burst, tpm, self.retention.rate_ms, max(0, reserve) if tpm > 0 else 0],
            )
        if got != 0:
            wait_ms, which = int(got[0]), got[1].decode()
            most = f"{rps:g} requests a second" if which == "requests_per_s" else f"{tpm} tokens a minute"
            raise RateLimited(
                f"tenant {tenant!r} is over its limit of {most} (LLAMAMESH_LIMITS_{which.upper()}); "
                f"retry in {wait_ms / 1000:.3f} s",
                retry_after_s=wait_ms / 1000,
            )

    async def spend(self, tenant: str, limits: LimitsSettings, tokens: int) -> None:
        """What a request generated less what it reserved at admission, taken off when it ends (below
        zero: the unused reservation given back): the bucket may go below zero, and later requests wait
        until it refilled."""
        if limits.tokens_per_min <= 0 or tokens == 0:
            return
        with unreachable():
            await self._spend(
                keys=[self.keys.tenant_rate(tenant)], args=[limits.tokens_per_min, tokens, self.retention.rate_ms]
            )

    async def open_stream(self, tenant: str, limits: LimitsSettings, stream_id: str) -> None:
        """Concurrent streams: a sorted set of stream ids with lease expiries; the gateway holding a
        stream renews it (``renew_streams``), so the streams of a gateway that died free themselves."""
        if limits.max_streams <= 0:
            return
        with unreachable():
            n = int(
                await self._open(
                    keys=[self.keys.tenant_streams(tenant)],
                    args=[stream_id, limits.max_streams, self.retention.stream_lease_ms],
                )
            )
        if n:
            raise RateLimited(
                f"tenant {tenant!r} has {n} streams open, its limit (LLAMAMESH_LIMITS_MAX_STREAMS); "
                "retry when one has ended",
                retry_after_s=1.0,
            )

    async def close_stream(self, tenant: str, stream_id: str) -> None:
        with unreachable():
            await self._r.zrem(self.keys.tenant_streams(tenant), stream_id)

    async def renew_streams(self, held: Mapping[str, str]) -> None:
        by_tenant: dict[str, list[str]] = {}
        for stream_id, tenant in held.items():
            by_tenant.setdefault(tenant, []).append(stream_id)
        if not by_tenant:
            return
        lease_ms = self.retention.stream_lease_ms
        with unreachable():
            await call_scripts(
                self._r,
                [
                    (self._renew, [self.keys.tenant_streams(tenant)], [lease_ms, *ids])
                    for tenant, ids in by_tenant.items()
                ],
            )

    async def reserve_batch(
        self, tenant: str, limits: LimitsSettings, batch_id: str, items: int, size: int, fingerprint: str = "-"
    ) -> bool:
        """Batches: items not finished and bytes kept, reserved whole when a batch is accepted (once
        per batch id: a resubmission reserves nothing; the first of two different batches under one
        id holds it, the other is AlreadyExists); ``give_back`` returns them."""
        k = self.keys
        with unreachable():
            # Listed before and after the hold is written: a sweep that found the tenant holding
            # nothing in between and unlisted it (``give_back``) cannot hide this hold from the next.
            await self._r.sadd(k.tenants_holding(), tenant)
            got: Any = await self._reserve(
                keys=[k.tenant_batch_quota(tenant), k.tenant_batches_held(tenant)],
                args=[batch_id, items, size, limits.max_batch_items, limits.max_batch_bytes, fingerprint or "-"],
            )
            await self._r.sadd(k.tenants_holding(), tenant)
        if got == -2:
            raise AlreadyExists(
                f"batch id {public_id(batch_id)!r} names another batch (other items) being submitted; resubmit it "
                "unchanged, or use a new id"
            )
        if got == -1:
            return False
        if got == 0:
            return True
        which, held = int(got[0]), int(got[1])
        if which == 1:
            raise RateLimited(
                f"tenant {tenant!r} has {held} batch items not finished; {items} more would pass its limit of "
                f"{limits.max_batch_items} (LLAMAMESH_LIMITS_MAX_BATCH_ITEMS)",
                retry_after_s=BATCH_ITEMS_RETRY_S,
            )
        raise RateLimited(
            f"tenant {tenant!r} keeps {held} bytes of batches; {size} more would pass its limit of "
            f"{limits.max_batch_bytes} (LLAMAMESH_LIMITS_MAX_BATCH_BYTES)",
            retry_after_s=BATCH_BYTES_RETRY_S,
        )

    def _give_call(self, tenant: str, batch_id: str, what: str) -> tuple[Any, list[str], list[str]]:
        k = self.keys
        return self._give_back, [k.tenant_batch_quota(tenant), k.tenant_batches_held(tenant)], [batch_id, what]

    async def _give(self, tenant: str, batch_id: str, what: str) -> Any:
        return (await call_scripts(self._r, [self._give_call(tenant, batch_id, what)]))[0]

    async def unreserve_batch(self, tenant: str, batch_id: str) -> None:
        with unreachable():
            await self._give(tenant, batch_id, "all")

    async def give_back(self, grace_s: float | None = None) -> int:
        """``Quotas.give_back`` (the gateways' batch sweep): the items when the batch ended, the bytes
        when its record expired; ``grace_s`` None: ``Retention.unstored_s``."""
        grace_s = self.retention.unstored_s if grace_s is None else grace_s
        k = self.keys
        changed = 0
        with unreachable():
            tenants: Any = await self._r.smembers(k.tenants_holding())
            for raw in tenants:
                tenant = raw.decode()
                held: Any = await self._r.hgetall(k.tenant_batches_held(tenant))
                if not held:
                    await self._r.srem(k.tenants_holding(), tenant)
                    if await self._r.exists(k.tenant_batches_held(tenant)):  # a hold written meanwhile
                        await self._r.sadd(k.tenants_holding(), tenant)
                    continue
                ids = [(bid.decode(), v.decode()) for bid, v in held.items()]
                secs, micros = await self._r.time()
                now_s = secs + micros / 1e6
                async with self._r.pipeline(transaction=False) as pipe:
                    for bid, _v in ids:
                        pipe.hget(k.batch(bid), "state")
                    states = await pipe.execute()
                gives = []
                for (bid, v), state in zip(ids, states, strict=True):
                    if state is None and now_s - int(v.split()[2]) / 1000 >= grace_s:
                        # purged (or never stored: its BatchGenerate died between reserving
                        # and storing; a younger hold may be a batch being stored right now)
                        gives.append(self._give_call(tenant, bid, "all"))
                    elif state is not None and state in _ENDED and not v.startswith("0 "):
                        gives.append(self._give_call(tenant, bid, "items"))
                await call_scripts(self._r, gives)
                changed += len(gives)
        return changed
