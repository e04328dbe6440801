"""The queue layer: every Redis Streams call llamamesh makes lives here."""

from llamamesh.queue.keys import Keys
from llamamesh.queue.protocol import JobQueue, Lease, WorkQueue

__all__ = ["JobQueue", "Keys", "Lease", "WorkQueue"]
