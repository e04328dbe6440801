"""How a closed loop's requests bunch, from per-request records: bench/load.py's ``--records`` lines and
`vllm bench serve --save-detailed` result files (plain or .xz).

For each run at --concurrency: TTFT p50 / p99, mean TTFT of each group of 128 requests in start order
(a group that is a prefix-cache hit, or a wave of simultaneous uncached arrivals, shows at once), and
request starts per 0.5 s (the waves themselves), and the mean TTFT, TPOT and end-to-end time: in a closed
loop that keeps the engine's throughput, a run with the lower TTFT has the higher TPOT, and every run
takes the same time end to end (docs/benchmarks.md).

  PYTHONPATH=. python3 bench/waves.py RESULTS/records.jsonl RESULTS/serve4-0/serve_c256.json --concurrency 256

(RESULTS: a folder bench/gpu_compare.sh wrote, under bench/results/.)
"""

from __future__ import annotations

import argparse
import json
import lzma
import statistics
from pathlib import Path

from bench.load import pct

TOKENS_OUT = 128  # every run of gpu_compare.sh: 128 tokens out, ignore_eos


def _open(path: Path) -> str:
    return lzma.open(path, "rt").read() if path.suffix == ".xz" else path.read_text()


def runs(paths: list[Path], concurrency: int) -> list[tuple[str, list[tuple[float, float, float]]]]:
    """(label, [(start s from the first start, TTFT s, end to end s)] in start order) of every run at
    ``concurrency``."""
    out = []
    for path in paths:
        text = _open(path)
        if text.lstrip().startswith('{"label"'):  # load.py --records: one JSON line per run
            for line in text.splitlines():
                d = json.loads(line)
                if d["concurrency"] == concurrency:
                    out.append((d["label"], sorted((s, t, end - s) for s, t, end in d["start_ttft_end"])))
        else:  # one vllm bench serve result
            d = json.loads(text)
            if d["max_concurrency"] == concurrency:
                t0 = min(d["start_times"])
                rows = sorted(
                    (s - t0, t, t + sum(itl)) for s, t, itl in zip(d["start_times"], d["ttfts"], d["itls"], strict=True)
                )
                out.append((f"vllm bench serve {path.parent.name}", rows))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--groups", type=int, default=8, help="groups of 128 requests to show")
    a = ap.parse_args()
    for label, rows in runs(a.files, a.concurrency):
        ttft = [t * 1e3 for _s, t, _e in rows]
        e2e = [e * 1e3 for _s, _t, e in rows]
        groups = [round(statistics.fmean(ttft[i : i + 128])) for i in range(0, min(len(ttft), 128 * a.groups), 128)]
        bins = [0] * 24
        for s, _t, _e in rows:
            if int(s / 0.5) < len(bins):
                bins[int(s / 0.5)] += 1
        print(f"{label[:40]:40} TTFT p50 {pct(ttft, 50):5.0f} p99 {pct(ttft, 99):5.0f} ms; by 128 in order: {groups}")
        print(f"{'':40} starts per 0.5 s: {' '.join(map(str, bins))}")
        tpot = statistics.fmean((e - t) / (TOKENS_OUT - 1) for t, e in zip(ttft, e2e, strict=True))
        print(
            f"{'':40} mean TTFT {statistics.fmean(ttft):5.0f} ms, TPOT {tpot:5.2f} ms, end to end "
            f"{statistics.fmean(e2e):5.0f} ms"
        )


if __name__ == "__main__":
    main()
