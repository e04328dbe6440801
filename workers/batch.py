"""Running one batch item: the whole completion, then exactly one recorded result.

A batch item streams nothing to anyone: its deltas are gathered and the result is recorded once
(``RedisBatches.record``: written only if the item has none yet, then acked). An item that
cannot finish here (the engine died, or the worker is stopping and aborted it) records nothing:
it stays leased, and another worker claims it once this one stops touching it.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from llamamesh import metrics, tracing
from llamamesh.backoff import Delays
from llamamesh.errors import EngineDead, LlamameshError, QueueUnavailable
from llamamesh.queue.protocol import BatchStore, Lease
from llamamesh.types import FinishReason, ItemResult, ItemStatus, Usage
from workers.samples import Samples

log = structlog.get_logger(__name__)


def skipped_result(lease: Lease) -> ItemResult:
    """The result of an item that does not run: its batch was cancelled, or its deadline passed."""
    cid = lease.request.custom_id
    if lease.cancelled:
        return ItemResult.unrun(cid, ItemStatus.CANCELLED, "the batch was cancelled or failed before this item started")
    return ItemResult.unrun(cid, ItemStatus.EXPIRED, "the batch's completion window ended before this item started")


async def record(batches: BatchStore, lease: Lease, result: ItemResult, **timings: float | None) -> None:
    """Record ``result``, retrying while Redis is unreachable (a result is never dropped here).
    ``timings`` (milliseconds) go into its log line."""
    delays = Delays()
    while True:
        try:
            fresh = await batches.record(lease, result)
            break
        except QueueUnavailable:
            log.warning("batch_record_failed", retry_in_s=round(await delays.wait(), 3))
    log.info("batch_item_finished", batch_id=lease.request.batch_id, custom_id=result.custom_id,
             status=result.status.value, duplicate=not fresh, **timings)  # fmt: skip
    if fresh:
        metrics.BATCH_ITEMS.labels(result.status.value).inc()


async def run_batch_item(lease: Lease, engine: Samples, batches: BatchStore) -> None:
    """Generate the item (every sample of it, n > 1) and record its result (under ``shield``). Raises
    EngineDead without recording, so the worker stops and the item goes to another worker."""
    req = lease.request
    n = req.sampling.samples
    texts: dict[int, list[str]] = {k: [] for k in range(n)}
    ends: dict[int, FinishReason] = {}
    n_tokens = 0
    first_token = 0
    engine_timings: tuple[tuple[str, float], ...] = ()
    result: ItemResult | None = None
    outcome = "cancelled"  # (for the span) unless it records a result or the engine dies
    # A span under the BatchGenerate RPC's: queue_wait from the batch's acceptance, then the item.
    started = time.time_ns()
    traced = tracing.JobSpan(req.trace, req.accepted_unix_ns, started, **{
        "llamamesh.request_id": req.request_id, "llamamesh.pool": lease.pool, "llamamesh.kind": "batch_item",
        "llamamesh.batch_id": req.batch_id})  # fmt: skip
    try:
        async for delta in engine.stream(req):
            texts[delta.sample].append(delta.text)
            n_tokens += len(delta.token_ids)
            if delta.token_ids and not first_token:
                first_token = time.time_ns()
            if delta.engine_timings_ms:
                engine_timings = delta.engine_timings_ms
            if delta.finish_reason is FinishReason.CANCELLED:
                return  # aborted by this worker's drain: another worker redoes it
            if delta.finish_reason is not None:
                ends[delta.sample] = delta.finish_reason
                if len(ends) < n:
                    continue  # (n > 1) the other samples go on
                samples = tuple(("".join(texts[k]), ends.get(k)) for k in range(n)) if n > 1 else ()
                result = ItemResult(req.custom_id, ItemStatus.SUCCEEDED, "".join(texts[0]), ends.get(0),
                                    Usage(delta.prompt_tokens or 0, n_tokens), samples=samples)  # fmt: skip
    except EngineDead:
        outcome = "engine_dead"
        raise
    except LlamameshError as exc:
        result = ItemResult(req.custom_id, ItemStatus.ERRORED, error_code=exc.code, error_message=exc.message)
    except Exception:
        log.exception("batch_item_crashed", batch_id=req.batch_id, custom_id=req.custom_id)
        result = ItemResult(req.custom_id, ItemStatus.ERRORED, error_code="internal", error_message="internal error")
    finally:
        if result is not None:
            outcome = "ok" if result.status is ItemStatus.SUCCEEDED else (result.error_code or result.status.value)
        traced.end(outcome, first_token)
    if result is not None:
        # When the item started after the batch was accepted, how long it ran, its first token, and
        # the engine's own split (bench/ttft_split.py reads them, as job_finished's).
        timings = {"start_ms": round((started - req.accepted_unix_ns) / 1e6, 2) if req.accepted_unix_ns else None,
                   "duration_ms": round((time.time_ns() - started) / 1e6, 2),
                   "first_token_ms": round((first_token - started) / 1e6, 2) if first_token else None,
                   **{f"{name}_ms": ms for name, ms in engine_timings}}  # fmt: skip
        await asyncio.shield(record(batches, lease, result, **timings))
