"""``MemoryLanes``: each pool's batch lanes in one process, leased as lease_items.lua leases them on
Redis: earliest deadline first (equal deadlines: the batch created first), at most
``LEASE_LANES`` + count lanes with items looked at, and the rest of a prefix group held for the
worker that leased its first item, ``hold_ms`` from then, while other lanes have items for the
others, and anyone's once that lapsed or another worker had nothing else to lease."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from llamamesh.queue.keys import LEASE_LANES, PREFIX_HOLD_MS
from llamamesh.types import BatchInfo, GenerationRequest

Entry = tuple[str, GenerationRequest]


@dataclass
class _Lane:
    order: tuple[float, float]  # (deadline, creation time)
    waiting: list[Entry] = field(default_factory=list)
    # (until, monotonic ms; worker; prefix key): the rest of the group at the lane's head is that
    # worker's until then; until 0: the hold lapsed, the group is anyone's
    hold: tuple[float, str, str] | None = None


class MemoryLanes:
    def __init__(self, hold_ms: int = PREFIX_HOLD_MS) -> None:
        self.hold_ms = hold_ms
        self._lanes: dict[str, dict[str, _Lane]] = {}  # pool -> batch id -> its lane
        self.pending: dict[str, dict[str, tuple[str, GenerationRequest]]] = {}  # pool -> entry -> (worker, item)

    def queue(self, pool: str, info: BatchInfo, entries: Iterable[Entry]) -> None:
        """Queue ``entries`` (already grouped by prefix key) onto the batch's lane of ``pool``."""
        lanes = self._lanes.setdefault(pool, {})
        lane = lanes.setdefault(info.batch_id, _Lane((info.expires_at, info.created_at)))
        lane.waiting.extend(entries)

    def ready(self, pool: str) -> bool:
        return any(lane.waiting for lane in self._lanes.get(pool, {}).values())

    def lanes(self, pool: str) -> list[str]:
        """Tests: the batch ids of the pool's lanes not deleted yet, earliest deadline first."""
        return [bid for bid, _lane in sorted(self._lanes.get(pool, {}).items(), key=lambda kv: kv[1].order)]

    def take(self, pool: str, consumer: str, count: int) -> list[Entry]:
        """Up to ``count`` items of the pool, leased to ``consumer``."""
        now = time.monotonic() * 1000
        lanes = sorted((x for x in self._lanes.get(pool, {}).values() if x.waiting), key=lambda x: x.order)
        taken: list[Entry] = []
        passed = []
        for lane in lanes[: LEASE_LANES + count]:
            if count - len(taken) <= 0:
                break
            if self._held(lane, consumer, now):
                passed.append(lane)
            else:
                taken += self._take(lane, consumer, count - len(taken), now)
        for lane in passed:  # nothing else to lease: the groups held for others, rather than nothing
            if count - len(taken) > 0:
                taken += self._take(lane, consumer, count - len(taken), now)
        pending = self.pending.setdefault(pool, {})
        for entry_id, req in taken:
            pending[entry_id] = (consumer, req)
        return taken

    @staticmethod
    def _held(lane: _Lane, consumer: str, now: float) -> bool:
        """Whether the group at the lane's head is another worker's now."""
        return lane.hold is not None and lane.hold[0] > now and lane.hold[1] != consumer

    def _take(self, lane: _Lane, consumer: str, left: int, now: float) -> list[Entry]:
        over = self._held(lane, consumer, now)  # taken over from the worker it was held for
        got, lane.waiting = lane.waiting[:left], lane.waiting[left:]
        key = got[-1][1].prefix_key
        if not lane.waiting or not key or lane.waiting[0][1].prefix_key != key:
            lane.hold = None
        elif lane.hold is None or lane.hold[2] != key:
            lane.hold = (now + self.hold_ms, consumer, key)
        elif 0 < lane.hold[0] <= now or over:  # lapsed or taken over: anyone's from now on
            lane.hold = (0.0, "", key)
        return got

    def ack(self, pool: str, entry_id: str) -> None:
        self.pending.get(pool, {}).pop(entry_id, None)

    def close(self, batch_id: str) -> None:
        """Delete the batch's lanes (every item of it has its result)."""
        for lanes in self._lanes.values():
            lanes.pop(batch_id, None)
