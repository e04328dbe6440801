"""What ``llamamesh top`` shows: one frame of a gateway's pools (AdminService.ListBackends) as text.

A pure function of the response, so that a test can render a hand-built one; the command
(llamamesh/cli.py) fetches, renders and redraws.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from llamamesh.v1 import admin_pb2 as pb

POOL_COLUMNS = ("POOL", "BREAKER", "SERVING", "READY", "STARTING", "FAILED", "INFLIGHT/SLOTS", "QUEUED", "LEASED",
                "WAIT", "TOK/S", "FALLBACK")  # fmt: skip
WORKER_COLUMNS = ("  WORKER", "STATE", "ENGINE", "MODEL", "INFLIGHT/SLOTS", "RUNNING", "WAITING", "KV", "DETAIL")


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows as left-aligned columns two spaces apart (the last one not padded)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=False)) + "  " + r[-1]).rstrip() for r in rows]


def _optional(b: pb.Backend, name: str) -> str:
    return str(getattr(b, name)) if b.HasField(name) else "?"


def pool_row(b: pb.Backend) -> list[str]:
    states = Counter(w.state for w in b.workers)
    inflight = sum(w.inflight for w in b.workers)
    slots = sum(w.max_inflight for w in b.workers if w.state == "ready")
    return [
        b.pool, b.breaker_state, "yes" if b.serving else "no", str(states["ready"]), str(states["starting"]),
        str(states["failed"]), f"{inflight}/{slots}", _optional(b, "queue_depth"), _optional(b, "queue_pending"),
        f"{b.queue_wait_s:.2f}s", f"{b.tokens_per_s:.1f}", b.fallback or "-",
    ]  # fmt: skip


def worker_row(w: pb.Worker) -> list[str]:
    return [
        f"  {w.name}", w.state, w.engine, w.model or "-", f"{w.inflight}/{w.max_inflight}", str(w.running),
        str(w.waiting), f"{w.kv_cache_usage:.0%}", w.detail,
    ]  # fmt: skip


def render(resp: pb.ListBackendsResponse, title: str = "") -> str:
    """One frame: a line per pool (workers by state; requests in flight over the ready workers'
    slots; jobs queued unleased and leased; recent queue wait; tokens per second), then its workers
    and, when it is not closed or its probe failed, why."""
    lines = [title] if title else []
    if not resp.backends:
        return "\n".join([*lines, "no backend pools"]) + "\n"
    lines += _table([POOL_COLUMNS, *(pool_row(b) for b in resp.backends)])
    for b in resp.backends:
        lines.append("")
        notes = []
        if b.breaker_state != "closed" and b.transitions:
            t = b.transitions[-1]
            notes.append(f"breaker {t.from_state} -> {t.to_state}: {t.reason}")
        if b.last_probe_error:
            notes.append(f"last probe: {b.last_probe_error}")
        lines.append(f"{b.pool}: {len(b.workers)} worker(s)" + (f"; {'; '.join(notes)}" if notes else ""))
        if b.workers:
            lines += _table([WORKER_COLUMNS, *(worker_row(w) for w in b.workers)])
    return "\n".join(lines).rstrip() + "\n"
