"""``MemoryQueue``: the queue's both faces (``JobQueue`` and ``WorkQueue``) in one process, each role
in its module as on Redis (submit, events, cancels, attempts, lease, reclaim, registry, adapters)."""

from __future__ import annotations

from llamamesh.queue.memory.adapters import MemoryAdapters
from llamamesh.queue.memory.attempts import MemoryAttempts
from llamamesh.queue.memory.cancels import MemoryCancels
from llamamesh.queue.memory.events import MemoryEvents
from llamamesh.queue.memory.lease import MemoryLeasing
from llamamesh.queue.memory.reclaim import MemoryReclaim
from llamamesh.queue.memory.submit import MemorySubmission


class MemoryQueue(
    MemorySubmission, MemoryEvents, MemoryCancels, MemoryAttempts, MemoryLeasing, MemoryReclaim, MemoryAdapters
):
    """JobQueue and WorkQueue in one process. ``down = True`` makes every call fail. No reclaim
    here (one process); fair share is plain round robin (memory/pool.py)."""
