"""Scripts of concurrent callers sent together: one pipeline per event-loop turn ("auto-pipelining",
as ioredis and Lettuce do it). Each request a gateway accepts runs two scripts before its job is
queued (its attempt record, then the submission): a burst of requests pays one round trip per
pipeline instead of one per script, and each caller still gets its own reply or its own error.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from llamamesh.queue.cluster import is_cluster
from llamamesh.queue.replicas import Replicas

# How many scripts one pipeline carries at most (a larger burst goes out in several).
MOST_PER_PIPELINE = 256


@dataclass(eq=False)
class _Call:
    script: Any  # redis-py's AsyncScript: .sha, .script
    keys: list[Any]
    args: list[Any]
    reply: asyncio.Future[list[Any]]


class ScriptPipe:
    """Concurrent callers' scripts, one pipeline per loop turn: the scripts queued in one turn go
    out as one pipeline on one connection, at most ``most_in_flight`` pipelines at a time (the calls
    queued meanwhile wait for the next), so a single call waits one turn more than alone. A script
    sent in a pipeline costs the gateway a fraction of the CPU it costs sent alone (redis-py,
    uvloop; docs/benchmarks.md).

    What does not change for a caller:

    - Its reply, or the error of its own script (a ``ResponseError`` reaches that caller only).
    - Retries: a pipeline is retried whole after a connection error by the client's retry (as a
      single command is); every script the queue sends this way is safe to repeat.
    - ``NOSCRIPT`` (the server restarted or its scripts were flushed): the scripts are loaded and
      the calls that got it sent again, once.
    - With ``replicas`` (``WAIT``), one ``WAIT`` ends the pipeline and covers every write in it;
      each caller gets ``[its reply, WAIT's reply]``, as ``Replicas.script`` answers.
    - A caller cancelled before its pipeline went out is dropped from it (its script never runs);
      one cancelled later leaves its script to run, as a command already sent does.
    - On a Redis Cluster, whose pipelines cannot hold scripts, every call goes out on its own.
    """

    def __init__(self, client: aioredis.Redis, replicas: Replicas | None = None, most_in_flight: int = 2) -> None:
        if most_in_flight < 1:
            raise ValueError(f"most_in_flight must be 1 or more, not {most_in_flight}")
        self._r = client
        self._replicas = replicas or Replicas()
        self._direct = is_cluster(client)
        self._most = most_in_flight
        self._queued: list[_Call] = []
        self._running: set[asyncio.Task[None]] = set()
        self._scheduled = False
        # Pipelines sent and scripts they carried, for tests and benchmarks.
        self.pipelines = 0
        self.scripts = 0

    async def call(self, script: Any, keys: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        """Run the registered ``script``: ``[its reply]``, with replicas ``[its reply, WAIT's]``.
        Raises what the client raises (a ``ResponseError`` of this script; a connection error of
        the whole pipeline, after the client's retries). Cancelled: see the class's docstring."""
        if self._direct:
            return await self._replicas.script(self._r, script, keys, args)
        reply: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._queued.append(_Call(script, list(keys), list(args), reply))
        self._kick()
        return await reply

    async def close(self) -> None:
        """Cancel the pipelines in flight and the calls still queued (their callers get CancelledError)."""
        for c in self._queued:
            c.reply.cancel()
        self._queued.clear()
        running = list(self._running)
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    def _kick(self) -> None:
        if self._queued and not self._scheduled and len(self._running) < self._most:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._start)

    def _start(self) -> None:
        self._scheduled = False
        self._queued = [c for c in self._queued if not c.reply.done()]  # callers cancelled meanwhile
        if not self._queued or len(self._running) >= self._most:
            return
        batch, self._queued = self._queued[:MOST_PER_PIPELINE], self._queued[MOST_PER_PIPELINE:]
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._running.add(task)
        task.add_done_callback(self._ran)

    def _ran(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._kick()

    async def _run(self, batch: list[_Call]) -> None:
        try:
            replies = await self._send(batch)
            missing = [i for i, r in enumerate(replies) if isinstance(r[0], NoScriptError)]
            if missing:
                for script in {id(batch[i].script): batch[i].script for i in missing}.values():
                    await self._r.script_load(script.script)
                for i, again in zip(missing, await self._send([batch[i] for i in missing]), strict=True):
                    replies[i] = again
        except asyncio.CancelledError:
            for c in batch:
                c.reply.cancel()
            raise
        except Exception as exc:  # the whole pipeline failed: each of its callers gets the error
            for c in batch:
                if not c.reply.done():
                    c.reply.set_exception(_own(exc))
            return
        for c, reply in zip(batch, replies, strict=True):
            if c.reply.done():
                continue
            if isinstance(reply[0], Exception):
                c.reply.set_exception(reply[0])
            else:
                c.reply.set_result(reply)

    async def _send(self, batch: list[_Call]) -> list[list[Any]]:
        """One pipeline of ``batch``'s scripts (and WAIT): each call's ``[reply(, WAIT's)]``; an
        error reply stays in its place."""
        self.pipelines += 1
        self.scripts += len(batch)
        async with self._r.pipeline(transaction=False) as pipe:
            for c in batch:
                pipe.evalsha(c.script.sha, len(c.keys), *c.keys, *c.args)
            self._replicas.wait(pipe)
            replies = list(await pipe.execute(raise_on_error=False))
        if self._replicas.count:
            acked = replies.pop()
            if isinstance(acked, Exception):  # WAIT refused: no caller's write is acknowledged
                return [[acked] for _ in replies]
            return [[r, acked] for r in replies]
        return [[r] for r in replies]


def _own(exc: BaseException) -> BaseException:
    """A copy of ``exc`` for each caller, so that their tracebacks do not pile up on one object."""
    try:
        return copy.copy(exc)
    except Exception:  # an exception that cannot be copied is shared
        return exc
