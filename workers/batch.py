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
from llamamesh.errors import EngineDead, InvalidRequest, LlamameshError, QueueUnavailable
from llamamesh.queue.protocol import BatchStore, Lease
from llamamesh.types import FinishReason, GenerationRequest, ItemResult, ItemStatus, TokenDelta, TokenLogprob, Usage
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
    log.info(
        "batch_item_finished",
        batch_id=lease.request.batch_id,
        custom_id=result.custom_id,
        status=result.status.value,
        duplicate=not fresh,
        **timings,
    )
    if fresh:
        metrics.BATCH_ITEMS.labels(result.status.value).inc()


class _Gathered:
    """What an item's stream produced: each sample's text and end, the tokens, the first token's
    time and the engine's own timings."""

    def __init__(self, req: GenerationRequest, pool: str) -> None:
        self.req = req
        self._counted = metrics.WORKER_TOKENS.labels(pool)  # (the worker's throughput, batch items too)
        self.n = req.sampling.samples
        self.texts: dict[int, list[str]] = {k: [] for k in range(self.n)}
        self.logprobs: dict[int, list[TokenLogprob]] | None = (
            {k: [] for k in range(self.n)} if req.sampling.logprobs is not None else None
        )
        self.ends: dict[int, FinishReason] = {}
        self.tokens = 0
        self.first_token = 0
        self.engine_timings: tuple[tuple[str, float], ...] = ()

    def add(self, delta: TokenDelta) -> ItemResult | None:
        """Take one delta; the item's result once every sample has ended."""
        self.texts[delta.sample].append(delta.text)
        if self.logprobs is not None:
            self.logprobs[delta.sample].extend(delta.logprobs)
        self.tokens += len(delta.token_ids)
        self._counted.inc(len(delta.token_ids))
        if delta.token_ids and not self.first_token:
            self.first_token = time.time_ns()
        if delta.engine_timings_ms:
            self.engine_timings = delta.engine_timings_ms
        if delta.finish_reason is None:
            return None
        self.ends[delta.sample] = delta.finish_reason
        if len(self.ends) < self.n:
            return None  # (n > 1) the other samples go on
        texts = ["".join(self.texts[k]) for k in range(self.n)]
        samples = tuple((texts[k], self.ends.get(k)) for k in range(self.n)) if self.n > 1 else ()
        usage = Usage(delta.prompt_tokens or 0, self.tokens, delta.cached_tokens or 0)
        lps = tuple(tuple(self.logprobs[k]) for k in range(self.n)) if self.logprobs is not None else ()
        ok = ItemStatus.SUCCEEDED
        return ItemResult(self.req.custom_id, ok, texts[0], self.ends.get(0), usage, samples=samples, logprobs=lps)

    def timings(self, started: int) -> dict[str, float | None]:
        """When the item started after the batch was accepted, how long it ran, its first token, and
        the engine's own split (bench/ttft_split.py reads them, as job_finished's)."""
        accepted = self.req.accepted_unix_ns
        return {
            "start_ms": round((started - accepted) / 1e6, 2) if accepted else None,
            "duration_ms": round((time.time_ns() - started) / 1e6, 2),
            "first_token_ms": round((self.first_token - started) / 1e6, 2) if self.first_token else None,
            **{f"{name}_ms": ms for name, ms in self.engine_timings},
        }


async def run_batch_item(lease: Lease, engine: Samples, batches: BatchStore) -> None:
    """Generate the item (every sample of it, n > 1) and record its result (under ``shield``). Raises
    EngineDead without recording, so the worker stops and the item goes to another worker."""
    req = lease.request
    gathered = _Gathered(req, lease.pool)
    result: ItemResult | None = None
    outcome = "cancelled"  # (for the span) unless it records a result or the engine dies
    # A span under the BatchGenerate RPC's: queue_wait from the batch's acceptance, then the item.
    started = time.time_ns()
    attributes = {"llamamesh.request_id": req.request_id, "llamamesh.pool": lease.pool}
    attributes |= {"llamamesh.kind": "batch_item", "llamamesh.batch_id": req.batch_id}
    traced = tracing.JobSpan(req.trace, req.accepted_unix_ns, started, attributes)
    try:
        async for delta in engine.stream(req):
            if delta.finish_reason is FinishReason.CANCELLED:
                return  # aborted by this worker's drain: another worker redoes it
            result = gathered.add(delta) or result
    except EngineDead:
        outcome = "engine_dead"
        raise
    except LlamameshError as exc:
        field = exc.violations[0].field if isinstance(exc, InvalidRequest) and exc.violations else ""
        result = ItemResult(
            req.custom_id, ItemStatus.ERRORED, error_code=exc.code, error_message=exc.message, error_field=field
        )
    except Exception:
        log.exception("batch_item_crashed", batch_id=req.batch_id, custom_id=req.custom_id)
        result = ItemResult(req.custom_id, ItemStatus.ERRORED, error_code="internal", error_message="internal error")
    finally:
        if result is not None:
            outcome = "ok" if result.status is ItemStatus.SUCCEEDED else (result.error_code or result.status.value)
        traced.end(outcome, gathered.first_token)
    if result is not None:
        await asyncio.shield(record(batches, lease, result, **gathered.timings(started)))
