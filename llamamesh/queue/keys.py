"""Every Redis key, stream, group and field name llamamesh uses, under one versioned prefix
(``Keys``), and how long each lives and how much of a stream is kept (``Retention``). Their table in
docs/architecture.md ("What travels through Redis") is rendered from here (queue/reference.py).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from llamamesh.queue.slots import shard_tags
from llamamesh.types import DEFAULT_TENANT

if TYPE_CHECKING:
    from llamamesh.settings import BatchSettings, RedisSettings

# How many slots request event streams are spread over (LLAMAMESH_REDIS_EVENT_SHARDS).
EVENT_SHARDS = 16

# Consumer group every worker of a pool joins on the pool's work stream.
WORKER_GROUP = "workers"
# Field of a work-stream entry holding the encoded Job.
JOB_FIELD = "j"
# Field of an event-stream entry holding the encoded JobEvent.
EVENT_FIELD = "e"
# Field of a wake-stream entry (the value is unused).
WAKE_FIELD = "w"
# Field of a batch results-stream entry holding the encoded ItemResult.
RESULT_FIELD = "r"
# Seconds a request's submitted marker lives: long past any retry of the write (a client's retry
# of the request is recognised by its attempts record instead), short enough to cost little.
SUBMITTED_TTL_S = 60
# Seconds a Cancel of a request id not (yet) in use holds: a Generate with that id begun meanwhile
# (a Cancel that overtook its Generate through another gateway) is cancelled, one begun later runs.
CANCEL_AHEAD_TTL_S = 10
# Milliseconds a tenant's open stream is held unless its gateway renews it (every third of it).
STREAM_LEASE_MS = 30_000
# Seconds a batch-quota hold whose batch has no record is kept: a younger one may be a batch being
# stored right now.
UNSTORED_GRACE_S = 60.0
# Seconds an unsealed batch is left to the submissions working on it before the sweep drops it.
UNSEALED_GRACE_S = 60.0
# Field of a batch lane entry holding the item's prefix key (absent: none).
GROUP_FIELD = "g"
# Milliseconds the rest of a batch's prefix group stays reserved for the worker that leased its
# first item (``Keys.batch_holds``), counted from then: a group all leased within it goes to that
# worker whole; what is left after it goes to any worker that asks (a group too large for one
# worker spreads over several, and never waits for a worker that is full or gone). Meanwhile a
# worker with nothing else to lease takes of it too, rather than wait: holds reorder work, no more.
PREFIX_HOLD_MS = 2000
# How many of a pool's lanes (in deadline order) one lease of batch items looks at.
LEASE_LANES = 16


def lane_member(created_at: float, batch_id: str) -> str:
    """A batch's lane in ``Keys.batch_lanes``: its creation time (fixed width, so that lanes of one
    deadline sort by it, as they were submitted), then its id (after the first ``:``)."""
    return f"{max(created_at, 0.0):020.6f}:{batch_id}"


def lane_batch(member: str) -> str:
    """The batch id of a ``lane_member``."""
    return member.partition(":")[2]


def stream_tenant(tenant: str) -> str:
    """The tenant as the work streams name it: "" for the default tenant (also ``DEFAULT_TENANT``),
    whose jobs wait in the pool's plain work stream."""
    return "" if tenant == DEFAULT_TENANT else tenant


@dataclass(frozen=True)
class Keys:
    """Every key's name. Per-request keys share a hash tag (``{<request_id>}``: the cancel flags, the
    attempts record); each pool's work streams (one per tenant with work there, ``jobs``) share the
    pool's slot, so that one XREADGROUP or one script may touch all of them. A request's event stream
    is the exception: it lives in one of ``event_shards`` slots picked by a hash of its id
    (``events``), spread evenly over the slot space, so that on a Redis Cluster a gateway reads the
    events of all its requests with one blocking XREAD per shard (follow.py), not one per request."""

    prefix: str = "llamamesh:v1"
    event_shards: int = EVENT_SHARDS

    def jobs(self, pool: str, tenant: str = "") -> str:
        """The work stream of one pool's tenant (consumer group ``workers``): the default tenant's is
        the pool's plain work stream, any other's a sub-stream beside it (same slot). Gateways add
        jobs; workers lease them, and ack and delete each after its terminal event (never trimmed)."""
        tenant = stream_tenant(tenant)
        return f"{self.prefix}:pool:{{{pool}}}:jobs" + (f":t:{tenant}" if tenant else "")

    def tenants(self, pool: str) -> str:
        """tenant -> weight of every tenant with a work stream in the pool (a hash; the default
        tenant is the field ""): what the workers' fair share leases over."""
        return f"{self.prefix}:pool:{{{pool}}}:tenants"

    def dead_letters(self, pool: str) -> str:
        """Poison jobs of a pool (a stream, trimmed to ``Retention.dead_letters``): the job, why, and
        how often it was delivered. Written by a worker that reclaims a job delivered too often, or
        by a gateway whose request's workers kept dying; read by operators."""
        return f"{self.prefix}:pool:{{{pool}}}:dead"

    def submitted(self, pool: str, request_id: str) -> str:
        """Present for ``Retention.submitted_s`` once a request was queued to a pool (in the pool's slot,
        beside its work stream): a retried submission is not queued twice."""
        return f"{self.prefix}:pool:{{{pool}}}:submitted:{request_id}"

    def events(self, request_id: str) -> str:
        """The event stream of one request (one entry per engine step), written by its worker, read
        by its gateway (one blocking XREAD per shard): in the slot of its shard, a CRC-32 of the id
        over ``LLAMAMESH_REDIS_EVENT_SHARDS``. Expires ``Retention.event_s`` after its terminal
        event."""
        tag = shard_tags(self.event_shards)[zlib.crc32(request_id.encode()) % self.event_shards]
        return f"{self.prefix}:ev:{{{tag}}}:{request_id}"

    def wake(self, follower_id: str, tag: str = "") -> str:
        """A gateway event follower's private stream: an entry returns its blocked XREAD. With
        ``tag``, the wake stream of its lane for that hash tag's slot (follow.py)."""
        if tag:
            return f"{self.prefix}:follower:{{{tag}}}:{follower_id}:wake"
        return f"{self.prefix}:follower:{{{follower_id}}}:wake"

    def cancel(self, request_id: str) -> str:
        """Present while a request is cancelled: set by its gateway when the caller went away; read
        by the worker at lease time and on its publishes (it aborts the request in the engine)."""
        return f"{self.prefix}:req:{{{request_id}}}:cancel"

    def epoch(self) -> str:
        """The identity of the queue's data (``<random id>@<Unix time it was set>``), set once by the
        first gateway: missing or changed, Redis lost it (every gateway's health check reads it)."""
        return f"{self.prefix}:epoch"

    def write_probe(self) -> str:
        """Written by each gateway's health check (expires after a minute): whether Redis takes writes."""
        return f"{self.prefix}:write-probe"

    def attempts(self, caller_id: str) -> str:
        """The attempts of a caller's request, in order (a list of JSON Attempt records), written by
        the gateway before it queues each; read by Attach and a retried Generate. Lives
        ``Retention.event_idle_s``, then as long as the events once the last attempt ends."""
        return f"{self.prefix}:req:{{{caller_id}}}:attempts"

    def attaches(self, caller_id: str) -> str:
        """How often a caller re-attached to its request (a counter): a detached stream's delayed
        cancel holds off when it moved."""
        return f"{self.prefix}:req:{{{caller_id}}}:attaches"

    def readers(self, caller_id: str) -> str:
        """How many callers read a resumable request now (a counter, Generate and Attach streams
        across the gateways): a detached stream's delayed cancel holds off while one still reads."""
        return f"{self.prefix}:req:{{{caller_id}}}:readers"

    def called_off(self, caller_id: str) -> str:
        """Present while the caller cancelled its request by id (Cancel RPC): every attempt stops. It
        takes the TTL the request's attempts record has when it is set (at most
        ``Retention.event_idle_s``; the record's own is cut when the request ends), or
        ``Retention.cancel_ahead_s`` when the id had none yet ("a"); a request begun under an id
        whose older request had been cancelled ("1") clears it."""
        return f"{self.prefix}:req:{{{caller_id}}}:called-off"

    def workers(self, pool: str) -> str:
        """The names of the workers that heartbeat in a pool (a set, written with each heartbeat;
        names whose heartbeat expired are pruned by the gateways that read it)."""
        return f"{self.prefix}:pool:{{{pool}}}:workers"

    def adapters(self, pool: str) -> str:
        """The LoRA adapters loaded at run time into a pool (a hash name -> path): AdminService
        LoadAdapter writes it, the pool's workers load what it lists at their next heartbeat."""
        return f"{self.prefix}:pool:{{{pool}}}:adapters"

    def worker(self, pool: str, name: str) -> str:
        """One worker's heartbeat (JSON WorkerStatus: state, in flight, the engine's figures), written
        every ``LLAMAMESH_WORKER_HEARTBEAT_S``, expiring after ``HEARTBEAT_TTL_S``; the node's
        supervisor writes a worker's exit into it. Gateways read it for liveness."""
        return f"{self.prefix}:pool:{{{pool}}}:worker:{name}"

    # --- batches: one hash tag per batch ({b:<id>}), so its keys share a Redis Cluster slot; its
    # items wait in lanes in their pool's slot, beside the pool's work streams

    def batch_items(self, pool: str) -> str:
        """The pool's shared batch stream, where every item of the pool waited before per-batch
        lanes: workers still lease what it holds (ahead of the lanes); nothing writes it."""
        return f"{self.prefix}:pool:{{{pool}}}:batch"

    def batch_lane(self, pool: str, batch_id: str) -> str:
        """A batch's items for one pool (a stream, consumer group ``workers``; in the pool's slot),
        queued sorted by prefix key so that each prefix's items follow each other. Deleted once the
        batch ended and no item waits for a result."""
        return f"{self.prefix}:pool:{{{pool}}}:batch:{batch_id}"

    def batch_lanes(self, pool: str) -> str:
        """The pool's lanes with items no worker has leased yet (a sorted set: ``lane_member`` ->
        the batch's deadline): workers lease from the first ones, earliest deadline first."""
        return f"{self.prefix}:pool:{{{pool}}}:batch-lanes"

    def batch_lanes_open(self, pool: str) -> str:
        """Every lane of the pool not deleted yet (a sorted set: ``lane_member`` -> deadline): where
        workers reclaim a dead worker's items and gateways prune idle consumers."""
        return f"{self.prefix}:pool:{{{pool}}}:batch-lanes-open"

    def batch_holds(self, pool: str) -> str:
        """Lanes whose next items continue a prefix group a worker leased the start of (a hash:
        ``lane_member`` -> ``"<until ms> <worker>\\n<prefix key>"``): until then only that worker
        leases from them while the others have other lanes to lease from (``PREFIX_HOLD_MS`` after
        it took the group's first item); until 0: the hold lapsed, or another worker with nothing
        else took of the group, and the rest of it is anyone's."""
        return f"{self.prefix}:pool:{{{pool}}}:batch-holds"

    def batch(self, batch_id: str) -> str:
        """A batch's record: state, counts, times (a hash)."""
        return f"{self.prefix}:batch:{{b:{batch_id}}}:meta"

    def batch_link(self, batch_id: str) -> str:
        """What the HTTP door keeps beside a batch it created: endpoint, input file (a hash)."""
        return f"{self.prefix}:batch:{{b:{batch_id}}}:door"

    def file(self, owner: str, file_id: str) -> str:
        """An uploaded file: its record's fields and its content (a hash)."""
        return f"{self.prefix}:file:{{{owner}}}:{file_id}"

    def files(self, owner: str) -> str:
        """An owner's uploaded files by upload time (a sorted set; its files' slot), until deleted."""
        return f"{self.prefix}:owner:{{{owner}}}:files"

    def files_bytes(self, owner: str) -> str:
        """The bytes an owner's uploaded files hold (a counter; its files' slot), against its
        ``max_batch_bytes``."""
        return f"{self.prefix}:owner:{{{owner}}}:files:bytes"

    def batch_done(self, batch_id: str) -> str:
        """custom_id -> status of every item with a result (a hash): one result per custom_id."""
        return f"{self.prefix}:batch:{{b:{batch_id}}}:done"

    def batch_results(self, batch_id: str) -> str:
        """The batch's results, in the order items finished (a stream)."""
        return f"{self.prefix}:batch:{{b:{batch_id}}}:results"

    def batch_ids(self, batch_id: str) -> str:
        """Every custom_id of the batch (a set): what a sweep ends when items cannot run."""
        return f"{self.prefix}:batch:{{b:{batch_id}}}:ids"

    def batch_started(self, batch_id: str) -> str:
        """custom_ids a worker has started (a set): a sweep leaves those to finish."""
        return f"{self.prefix}:batch:{{b:{batch_id}}}:started"

    def batch_queued(self, batch_id: str) -> str:
        """custom_ids of the items a submission has queued (a set), until the batch is sealed
        (llamamesh/queue/intake.py)."""
        return f"{self.prefix}:batch:{{b:{batch_id}}}:queued"

    def batches_unsealed(self) -> str:
        """Batches being submitted, by when the sweep may drop them if still unsealed (a sorted set)."""
        return f"{self.prefix}:batches:unsealed"

    def batches_open(self) -> str:
        """Unfinished batches by deadline (a sorted set): the gateways' sweeper expires them."""
        return f"{self.prefix}:batches:open"

    def batches(self, owner: str) -> str:
        """An owner's batches by creation time (a sorted set)."""
        return f"{self.prefix}:owner:{{{owner}}}:batches"

    def batches_kept(self) -> str:
        """Every batch by the earliest time its record may be gone (a sorted set of JSON
        ``[owner, batch_id]``): the sweep takes purged batches off their owner's list."""
        return f"{self.prefix}:batches:kept"

    # --- tenants' budgets (quotas.py): one hash tag per tenant ({t:<tenant>}): one slot per check

    def tenant_rate(self, tenant: str) -> str:
        """The tenant's request and token buckets (a hash: level and time of each)."""
        return f"{self.prefix}:tenant:{{t:{tenant}}}:rate"

    def tenant_streams(self, tenant: str) -> str:
        """The tenant's open streams (a sorted set: stream id -> lease expiry, ms)."""
        return f"{self.prefix}:tenant:{{t:{tenant}}}:streams"

    def tenant_batch_quota(self, tenant: str) -> str:
        """The tenant's batch items not finished and batch bytes kept (a hash: items, bytes)."""
        return f"{self.prefix}:tenant:{{t:{tenant}}}:batch-quota"

    def tenant_batches_held(self, tenant: str) -> str:
        """What each of the tenant's batches holds of that quota (a hash: batch id -> "items bytes")."""
        return f"{self.prefix}:tenant:{{t:{tenant}}}:batch-held"

    def tenants_holding(self) -> str:
        """Tenants whose batches hold quota (a set): the sweep gives back what ended batches held."""
        return f"{self.prefix}:tenants:holding"

    # --- prefix affinity (llamamesh/queue/affinity.py): in the pool's slot, beside its work streams

    def jobs_part(self, pool: str, tenant: str, partition: int) -> str:
        """Partition ``partition`` of a tenant's work stream of the pool (affinity on)."""
        return f"{self.jobs(pool, tenant)}:p{partition}"

    def work(self, pool: str, tenant: str, partition: int | None) -> str:
        """The work stream that holds a tenant's entry: its partition's (affinity on), else ``jobs``."""
        return self.jobs(pool, tenant) if partition is None else self.jobs_part(pool, tenant, partition)

    def owners(self, pool: str) -> str:
        """Who owns each partition of the pool (a hash: ``"<k>" -> "<worker> <expiry ms>"``, and
        ``"m:<worker>" -> <expiry ms>`` for each ready worker that takes a share)."""
        return f"{self.prefix}:pool:{{{pool}}}:owners"

    def partitions(self, pool: str) -> str:
        """The pool's number of affinity partitions, recorded by the first gateway or worker that
        uses the pool with affinity on: all of them must agree."""
        return f"{self.prefix}:pool:{{{pool}}}:partitions"

    def placements(self, pool: str) -> str:
        """Balanced placement: each prefix key's partition (a hash: ``"<tenant>\\n<key>"`` -> k)."""
        return f"{self.prefix}:pool:{{{pool}}}:placed"

    def placements_used(self, pool: str) -> str:
        """Balanced placement: when each placed key was last used (a sorted set by ms)."""
        return f"{self.prefix}:pool:{{{pool}}}:placed-used"

    def placements_load(self, pool: str) -> str:
        """Balanced placement: how many placed keys each partition holds (a hash: partition -> count)."""
        return f"{self.prefix}:pool:{{{pool}}}:placed-load"


@dataclass(frozen=True)
class Retention:
    """How long what the queue writes lives in Redis, and how much of a stream is kept: every TTL
    and bound, built once from the settings (``of``); the code and the scripts' arguments take
    them from here."""

    # An event stream once its terminal event is written (LLAMAMESH_REDIS_EVENT_TTL_S).
    event_s: int = 300
    # An event stream without a terminal event (its worker lost; LLAMAMESH_REDIS_EVENT_IDLE_TTL_S).
    # A request's attempts record, re-attach count and cancel flag, and a gateway follower's wake
    # stream, live as long.
    event_idle_s: int = 3600
    # While its worker publishes, an event stream's TTL is renewed every this fraction of it.
    renew_fraction: float = 0.25
    # A request's submitted marker (never longer than ``event_idle_s``: ``submitted_ttl_s``).
    submitted_s: int = SUBMITTED_TTL_S
    # A Cancel of a request id not (yet) in use.
    cancel_ahead_s: int = CANCEL_AHEAD_TTL_S
    # A gateway's write probe.
    write_probe_s: int = 60
    # Entries each pool's dead-letter stream keeps, trimmed approximately
    # (LLAMAMESH_REDIS_DEAD_LETTER_MAXLEN; 0: no bound).
    dead_letters: int = 10_000
    # A consumer of a pool's groups holding no entry leaves them once idle this long
    # (LLAMAMESH_REDIS_CONSUMER_IDLE_S; 0: never).
    consumer_idle_s: int = 3600
    # A batch's record and results once it ended (LLAMAMESH_BATCH_RETENTION_S).
    batch_s: int = 7 * 86400
    # A batch whose submission failed half-way (unsealed) before the sweep drops it.
    unsealed_s: float = UNSEALED_GRACE_S
    # A tenant's rate buckets once unused (full again by then).
    rate_ms: int = 120_000
    # A tenant's open stream unless its gateway renews it.
    stream_lease_ms: int = STREAM_LEASE_MS
    # A batch-quota hold whose batch has no record.
    unstored_s: float = UNSTORED_GRACE_S

    @classmethod
    def of(cls, redis: RedisSettings | None = None, batch: BatchSettings | None = None) -> Retention:
        """The retention the settings give (the defaults for those not given)."""
        out = cls()
        if redis is not None:
            out = replace(
                out,
                event_s=redis.event_ttl_s,
                event_idle_s=redis.event_idle_ttl_s,
                dead_letters=redis.dead_letter_maxlen,
                consumer_idle_s=redis.consumer_idle_s,
            )
        if batch is not None:
            out = replace(out, batch_s=batch.retention_s)
        return out

    @property
    def submitted_ttl_s(self) -> int:
        return min(self.submitted_s, self.event_idle_s)
