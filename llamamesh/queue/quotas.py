"""Every tenant's budgets, in Redis, shared by all gateways: each check is one Lua script on the
tenant's keys (one hash tag, ``{t:<tenant>}``), so N gateways enforce one budget and two racing
requests cannot both take its last unit. Time is Redis's own (``TIME``), not each gateway's clock.

- Requests per second: a token bucket (``requests_per_s``, ``burst``).
- Tokens per minute: a bucket that refills at ``tokens_per_min`` a minute; a request is admitted
  while it is above zero, and what it generated is taken off when it ends (so it may go below
  zero: later requests wait until it refilled).
- Concurrent streams: a sorted set of stream ids with lease expiries; the gateway holding a stream
  renews it (``renew_streams``), so the streams of a gateway that died free themselves.
- Batches: items not finished and bytes kept, reserved whole when a batch is accepted (once per
  batch id: a resubmission reserves nothing), given back by ``give_back`` (the gateways' batch
  sweep): the items when the batch ended, the bytes when its record expired.

A limit of 0 is no limit; a check with every limit at 0 costs no round trip. Over a limit:
RateLimited with the seconds until it would pass (RetryInfo). Redis errors: QueueUnavailable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

import redis.asyncio as aioredis

from llamamesh.errors import RateLimited
from llamamesh.queue.keys import Keys
from llamamesh.queue.redisio import call_scripts, unreachable
from llamamesh.settings import LimitsSettings

# A stream's lease: a gateway renews its open streams every third of it.
STREAM_LEASE_MS = 30_000
# What a refused batch is told: items free as batches end (the sweep gives them back every few
# seconds); bytes only when finished batches' results expire.
BATCH_ITEMS_RETRY_S = 5.0
BATCH_BYTES_RETRY_S = 60.0
# A hold whose batch has no record is given back only once it is this old (seconds).
UNSTORED_GRACE_S = 60.0

_NOW = "local t = redis.call('TIME'); local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"

# KEYS: rate hash. ARGV: requests/s, burst, tokens/min. Returns 0 (admitted) or
# {wait ms, which}. Nothing changes when refused.
_ADMIT = _NOW + """
local rps, burst, tpm = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local h = redis.call('HMGET', KEYS[1], 'r', 'rt', 't', 'tt')
local r, t
if rps > 0 then
  r = math.min(burst, (tonumber(h[1]) or burst) + (now - (tonumber(h[2]) or now)) * rps / 1000)
  if r < 1 then return {math.ceil((1 - r) * 1000 / rps), 'requests_per_s'} end
end
if tpm > 0 then
  t = math.min(tpm, (tonumber(h[3]) or tpm) + (now - (tonumber(h[4]) or now)) * tpm / 60000)
  if t <= 0 then return {math.ceil((1 - t) * 60000 / tpm), 'tokens_per_min'} end
end
if rps > 0 then redis.call('HSET', KEYS[1], 'r', tostring(r - 1), 'rt', now) end
if tpm > 0 then redis.call('HSET', KEYS[1], 't', tostring(t), 'tt', now) end
redis.call('PEXPIRE', KEYS[1], 120000)
return 0
"""

# KEYS: rate hash. ARGV: tokens/min, tokens generated.
_SPEND = _NOW + """
local tpm, n = tonumber(ARGV[1]), tonumber(ARGV[2])
local h = redis.call('HMGET', KEYS[1], 't', 'tt')
local t = math.min(tpm, (tonumber(h[1]) or tpm) + (now - (tonumber(h[2]) or now)) * tpm / 60000)
redis.call('HSET', KEYS[1], 't', tostring(t - n), 'tt', now)
redis.call('PEXPIRE', KEYS[1], 120000)
return 0
"""

# KEYS: streams zset. ARGV: stream id, most, lease ms. Returns 0 (opened) or how many are open.
_OPEN = _NOW + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local n = redis.call('ZCARD', KEYS[1])
if n >= tonumber(ARGV[2]) and not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return n end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return 0
"""

# KEYS: streams zset. ARGV: lease ms, stream ids... (only those still there are renewed).
_RENEW = _NOW + """
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]))
return 0
"""

# KEYS: quota hash, held hash. ARGV: batch id, items, bytes, most items, most bytes. A hold is
# "items bytes reserved-at-ms". Returns -1
# (held already: a resubmission), 0 (reserved), {1, items held} or {2, bytes held} (over).
_RESERVE = _NOW + """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return -1 end
local items = tonumber(redis.call('HGET', KEYS[1], 'items') or '0')
local bytes = tonumber(redis.call('HGET', KEYS[1], 'bytes') or '0')
local n, b, most_n, most_b = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if most_n > 0 and items + n > most_n then return {1, items} end
if most_b > 0 and bytes + b > most_b then return {2, bytes} end
redis.call('HINCRBY', KEYS[1], 'items', n)
redis.call('HINCRBY', KEYS[1], 'bytes', b)
redis.call('HSET', KEYS[2], ARGV[1], n .. ' ' .. b .. ' ' .. now)
return 0
"""

# KEYS: quota hash, held hash. ARGV: batch id, what ('items': the batch ended; 'all': its record
# is gone). Safe to repeat: what was given back is no longer held.
_GIVE_BACK = """
local held = redis.call('HGET', KEYS[2], ARGV[1])
if not held then return 0 end
local n, b, at = string.match(held, '(%d+) (%d+) (%d+)')
n, b = tonumber(n), tonumber(b)
if n > 0 then redis.call('HINCRBY', KEYS[1], 'items', -n) end
if ARGV[2] == 'all' then
  redis.call('HINCRBY', KEYS[1], 'bytes', -b)
  redis.call('HDEL', KEYS[2], ARGV[1])
elseif n > 0 then
  redis.call('HSET', KEYS[2], ARGV[1], '0 ' .. b .. ' ' .. at)
end
return 1
"""

_ENDED = {b"completed", b"failed", b"expired", b"cancelled"}


class Quotas(Protocol):
    async def admit(self, tenant: str, limits: LimitsSettings) -> None:
        """Take one request from the tenant's request bucket, if its token bucket is above zero.
        Raises RateLimited (nothing taken) or QueueUnavailable."""

    async def spend(self, tenant: str, limits: LimitsSettings, tokens: int) -> None:
        """Take ``tokens`` (what a request generated) off the tenant's token bucket."""

    async def open_stream(self, tenant: str, limits: LimitsSettings, stream_id: str) -> None:
        """Hold one of the tenant's concurrent streams; raises RateLimited when all are held."""

    async def close_stream(self, tenant: str, stream_id: str) -> None: ...

    async def renew_streams(self, held: Mapping[str, str]) -> None:
        """Extend the leases of the streams this gateway holds (stream id -> tenant)."""

    async def reserve_batch(self, tenant: str, limits: LimitsSettings, batch_id: str, items: int, size: int) -> bool:
        """Hold a new batch's items and bytes; False when this batch holds them already. Raises
        RateLimited when the tenant's items or bytes would go over."""
        ...

    async def unreserve_batch(self, tenant: str, batch_id: str) -> None:
        """Give back all a batch held (it was not stored after all)."""

    async def give_back(self, grace_s: float = UNSTORED_GRACE_S) -> int:
        """Give back what ended batches held (items) and purged ones (bytes: a hold without a batch
        record, once older than ``grace_s``); how many changed."""
        ...


class RedisQuotas:
    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self._r = client
        self.keys = keys
        self._admit = client.register_script(_ADMIT)
        self._spend = client.register_script(_SPEND)
        self._open = client.register_script(_OPEN)
        self._renew = client.register_script(_RENEW)
        self._reserve = client.register_script(_RESERVE)
        self._give_back = client.register_script(_GIVE_BACK)

    async def admit(self, tenant: str, limits: LimitsSettings) -> None:
        rps, tpm = limits.requests_per_s, limits.tokens_per_min
        if rps <= 0 and tpm <= 0:
            return
        burst = limits.burst or max(1, math.ceil(rps))
        with unreachable():
            got: Any = await self._admit(keys=[self.keys.tenant_rate(tenant)], args=[rps, burst, tpm])
        if got != 0:
            wait_ms, which = int(got[0]), got[1].decode()
            most = f"{rps:g} requests a second" if which == "requests_per_s" else f"{tpm} tokens a minute"
            raise RateLimited(
                f"tenant {tenant!r} is over its limit of {most} (LLAMAMESH_LIMITS_{which.upper()}); "
                f"retry in {wait_ms / 1000:.3f} s", retry_after_s=wait_ms / 1000,
            )  # fmt: skip

    async def spend(self, tenant: str, limits: LimitsSettings, tokens: int) -> None:
        if limits.tokens_per_min <= 0 or tokens <= 0:
            return
        with unreachable():
            await self._spend(keys=[self.keys.tenant_rate(tenant)], args=[limits.tokens_per_min, tokens])

    async def open_stream(self, tenant: str, limits: LimitsSettings, stream_id: str) -> None:
        if limits.max_streams <= 0:
            return
        with unreachable():
            n = int(await self._open(keys=[self.keys.tenant_streams(tenant)],
                                     args=[stream_id, limits.max_streams, STREAM_LEASE_MS]))  # fmt: skip
        if n:
            raise RateLimited(
                f"tenant {tenant!r} has {n} streams open, its limit (LLAMAMESH_LIMITS_MAX_STREAMS); "
                "retry when one has ended", retry_after_s=1.0,
            )  # fmt: skip

    async def close_stream(self, tenant: str, stream_id: str) -> None:
        with unreachable():
            await self._r.zrem(self.keys.tenant_streams(tenant), stream_id)

    async def renew_streams(self, held: Mapping[str, str]) -> None:
        by_tenant: dict[str, list[str]] = {}
        for stream_id, tenant in held.items():
            by_tenant.setdefault(tenant, []).append(stream_id)
        if not by_tenant:
            return
        with unreachable():
            await call_scripts(self._r, [(self._renew, [self.keys.tenant_streams(tenant)], [STREAM_LEASE_MS, *ids])
                                         for tenant, ids in by_tenant.items()])  # fmt: skip

    async def reserve_batch(self, tenant: str, limits: LimitsSettings, batch_id: str, items: int, size: int) -> bool:
        k = self.keys
        with unreachable():
            await self._r.sadd(k.tenants_holding(), tenant)  # first: the sweep must find what is held
            got: Any = await self._reserve(
                keys=[k.tenant_batch_quota(tenant), k.tenant_batches_held(tenant)],
                args=[batch_id, items, size, limits.max_batch_items, limits.max_batch_bytes],
            )
        if got == -1:
            return False
        if got == 0:
            return True
        which, held = int(got[0]), int(got[1])
        if which == 1:
            raise RateLimited(
                f"tenant {tenant!r} has {held} batch items not finished; {items} more would pass its limit of "
                f"{limits.max_batch_items} (LLAMAMESH_LIMITS_MAX_BATCH_ITEMS)", retry_after_s=BATCH_ITEMS_RETRY_S,
            )  # fmt: skip
        raise RateLimited(
            f"tenant {tenant!r} keeps {held} bytes of batches; {size} more would pass its limit of "
            f"{limits.max_batch_bytes} (LLAMAMESH_LIMITS_MAX_BATCH_BYTES)", retry_after_s=BATCH_BYTES_RETRY_S,
        )  # fmt: skip

    def _give_call(self, tenant: str, batch_id: str, what: str) -> tuple[Any, list[str], list[str]]:
        k = self.keys
        return self._give_back, [k.tenant_batch_quota(tenant), k.tenant_batches_held(tenant)], [batch_id, what]

    async def _give(self, tenant: str, batch_id: str, what: str) -> Any:
        return (await call_scripts(self._r, [self._give_call(tenant, batch_id, what)]))[0]

    async def unreserve_batch(self, tenant: str, batch_id: str) -> None:
        with unreachable():
            await self._give(tenant, batch_id, "all")

    async def give_back(self, grace_s: float = UNSTORED_GRACE_S) -> int:
        k = self.keys
        changed = 0
        with unreachable():
            tenants: Any = await self._r.smembers(k.tenants_holding())
            for raw in tenants:
                tenant = raw.decode()
                held: Any = await self._r.hgetall(k.tenant_batches_held(tenant))
                if not held:
                    await self._r.srem(k.tenants_holding(), tenant)
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
