"""Where the time to first token goes, on both sides of the GPU comparison (bench/gpu_compare.sh).

  python bench/ttft_split.py worker WORKER_LOG --since T0 --until T1 --label L
      llamamesh: the worker's ``job_finished`` lines (JSON logs, info level) of jobs that finished in
      [T0, T1] (epoch seconds): gateway accept -> first token (``ttft_ms``), the gateway-to-worker
      queue wait, our tokenisation, and vLLM's own split of the rest (arrival -> first token, waiting
      in the scheduler's queue, prefill). The gateways' health probes are left out; the load's
      warm-ups are in.
  python bench/ttft_split.py prom METRICS_FILE --label L
      `vllm serve`: lines "EPOCH metric{labels} value" polled from its /metrics; cut into load
      phases where the finished-request count stops moving, and for each phase the means of vLLM's
      TTFT (arrival -> first token), queue time and prefill time histograms.

Prints one JSON line per phase (means and p50s in ms).
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import datetime

FIELDS = ("ttft_ms", "queue_wait_ms", "tokenize_ms", "vllm_ttft_ms", "vllm_queue_ms", "vllm_prefill_ms")
PROM = {
    "vllm_ttft_ms": "vllm:time_to_first_token_seconds",
    "vllm_queue_ms": "vllm:request_queue_time_seconds",
    "vllm_prefill_ms": "vllm:request_prefill_time_seconds",
}


def _p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def worker_split(path: str, since: float, until: float) -> dict:
    cols: dict[str, list[float]] = {f: [] for f in FIELDS}
    with open(path, errors="replace") as f:
        for line in f:
            if '"job_finished"' not in line:
                continue
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            t = datetime.fromisoformat(ev["timestamp"].replace("Z", "+00:00")).timestamp()
            probe = ev.get("request_id", "").startswith(("probe~", "probe-"))  # "probe~" since 367417a
            if not since <= t <= until or ev.get("status") != "ok" or probe:
                continue
            for f_ in FIELDS:
                if isinstance(ev.get(f_), int | float):
                    cols[f_].append(float(ev[f_]))
    out: dict = {"requests": len(cols["ttft_ms"])}
    for f_, xs in cols.items():
        out[f_.replace("_ms", "_mean_ms")] = round(statistics.fmean(xs), 1) if xs else None
        out[f_.replace("_ms", "_p50_ms")] = round(_p50(xs), 1) if xs else None
    return out


def _prom_totals(path: str) -> list[tuple[float, dict[str, float]]]:
    """(time, {metric_sum/metric_count: value summed over label sets}) per poll."""
    polls: dict[float, dict[str, float]] = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) != 3:
                continue
            t, name, value = float(parts[0]), parts[1].split("{", 1)[0], float(parts[2])
            row = polls.setdefault(t, {})
            row[name] = row.get(name, 0.0) + value
    return sorted(polls.items())


def prom_split(path: str, quiet_polls: int = 3) -> list[dict]:
    polls = _prom_totals(path)
    count = PROM["vllm_ttft_ms"] + "_count"
    phases: list[tuple[int, int]] = []  # (index before the phase, last index of the phase)
    start = last_move = None
    still = 0
    for i in range(1, len(polls)):
        moved = polls[i][1].get(count, 0.0) > polls[i - 1][1].get(count, 0.0)
        if moved:
            if start is None:
                start = i - 1
            last_move, still = i, 0
        elif start is not None:
            still += 1
            if still >= quiet_polls:
                phases.append((start, last_move))  # type: ignore[arg-type]
                start = None
    if start is not None:
        phases.append((start, last_move))  # type: ignore[arg-type]
    out = []
    for a, b in phases:
        before, after = polls[a][1], polls[b][1]
        row: dict = {
            "requests": int(after.get(count, 0) - before.get(count, 0)),
            "seconds": round(polls[b][0] - polls[a][0], 1),
        }
        for key, metric in PROM.items():
            n = after.get(metric + "_count", 0) - before.get(metric + "_count", 0)
            s = after.get(metric + "_sum", 0) - before.get(metric + "_sum", 0)
            row[key.replace("_ms", "_mean_ms")] = round(s / n * 1e3, 1) if n else None
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", choices=["worker", "prom"])
    ap.add_argument("path")
    ap.add_argument("--since", type=float, default=0.0)
    ap.add_argument("--until", type=float, default=float("inf"))
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    rows = [worker_split(a.path, a.since, a.until)] if a.source == "worker" else prom_split(a.path)
    for r in rows:
        print(json.dumps({"label": a.label, "kind": "ttft_split", **r}), flush=True)


if __name__ == "__main__":
    main()
