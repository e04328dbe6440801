"""In-memory fakes of the queue (``MemoryQueue``), the batch store (``MemoryBatches``) and the file
store (``MemoryFiles``), with the
contracts of the Redis ones, split by role as they are. For unit and in-process tests of one layer;
never the only proof of anything.
"""

from llamamesh.queue.keys import CANCEL_AHEAD_TTL_S
from llamamesh.queue.memory.batches import MemoryBatches
from llamamesh.queue.memory.files import MemoryFiles
from llamamesh.queue.memory.queue import MemoryQueue

# CANCEL_AHEAD_TTL_S: tests shorten it here (memory/cancels.py reads it from here at each call).
__all__ = ["CANCEL_AHEAD_TTL_S", "MemoryBatches", "MemoryFiles", "MemoryQueue"]
