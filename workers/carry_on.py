"""Carrying on a job a dead worker had begun (or a drained one handed back): the worker that reclaims
it reads what its event stream holds (``Lease.begun``) and runs the rest in place, on the same
stream, so a request nobody follows at that moment (its caller detached from a resumable request, or
its gateway gone) still ends whole.
The tokens already published are fed after the input, as a gateway's failover does, and the new
events are numbered on from them: to a reader, the stream simply goes on.

A gateway that follows the request usually sees the worker lost first (its heartbeat stops well
before a lease is idle long enough to reclaim), cancels the attempt and resumes it as a new one; the
reclaiming worker then finds it cancelled and skips it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from llamamesh.types import Finished, FinishReason, GenerationRequest, JobEvent, Usage


@dataclass(frozen=True)
class Carried:
    """What the reclaiming worker runs: ``request`` (the stream's tokens fed after the input, with the
    rest of the budget), each running sample's next token index on the stream (``next_index``), the
    tokens the stream holds over every sample (``generated``), and events to publish before it runs
    (``ends``: samples whose whole budget is on the stream). ``done``: nothing is left to run; this
    terminal event ends the job."""

    request: GenerationRequest
    next_index: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))
    generated: int = 0
    ends: tuple[JobEvent, ...] = ()
    done: JobEvent | None = None


def carried(request: GenerationRequest, begun: Sequence[JobEvent], worker: str) -> Carried | None:
    """How to go on with ``request`` after the events ``begun`` its dead worker published; None when
    it cannot (the stream ended already, or has a gap: the job then ends worker_died, for a
    following gateway to resume)."""
    tokens: dict[int, list[int]] = {}
    ended: set[int] = set()
    for ev in begun:
        if ev.handed_back:
            continue  # a worker that gave it up: what it wrote before counts
        if ev.terminal:
            return None
        got = tokens.setdefault(ev.sample, [])
        if ev.index > len(got):
            return None  # a gap
        got += ev.token_ids[len(got) - ev.index :]  # a retried publish may have written a repeat
        if ev.sample_end is not None:
            ended.add(ev.sample)
    generated = sum(len(t) for t in tokens.values())
    if request.sampling.samples == 1 and not request.resume_samples:
        return _one(request, tuple(tokens.get(0, ())), generated, worker)
    return _several(request, tokens, ended, generated, worker)


def _one(request: GenerationRequest, got: tuple[int, ...], generated: int, worker: str) -> Carried:
    s = request.sampling
    if s.max_tokens is not None and len(got) >= s.max_tokens:
        return Carried(request, generated=generated, done=_length_end(len(got), 0, generated, worker))
    resumed = replace(request, resume_token_ids=request.resume_token_ids + got, sampling=s.after(len(got)))
    return Carried(resumed, MappingProxyType({0: len(got)}), generated)


def _several(
    request: GenerationRequest, tokens: dict[int, list[int]], ended: set[int], generated: int, worker: str
) -> Carried | None:
    """Several samples: each one not ended goes on from its tokens (those an earlier attempt gave its
    caller, then the stream's); one whose whole budget is there ends LENGTH, and the last to end
    carries the terminal event."""
    before = request.resume_samples or dict.fromkeys(range(request.sampling.samples), ())
    most = request.sampling.max_tokens
    todo: dict[int, tuple[int, ...]] = {}
    spent: list[int] = []
    if not set(before) - ended:
        return None  # every sample ended, the terminal event unwritten: its end is not known
    for k in sorted(before):
        if k in ended:
            continue
        done = tuple(before[k]) + tuple(tokens.get(k, ()))
        if most is not None and len(done) >= most:
            spent.append(k)
        else:
            todo[k] = done
    ends = [
        JobEvent(index=len(tokens.get(k, ())), sample=k, sample_end=FinishReason.LENGTH, worker=worker) for k in spent
    ]
    if not todo:
        last = ends.pop()
        done_ev = _length_end(last.index, last.sample, generated, worker)
        return Carried(request, generated=generated, ends=tuple(ends), done=done_ev)
    resumed = replace(request, resume_samples=MappingProxyType(todo))
    at = MappingProxyType({k: len(tokens.get(k, ())) for k in todo})
    return Carried(resumed, at, generated, tuple(ends))


def _length_end(index: int, sample: int, generated: int, worker: str) -> JobEvent:
    return JobEvent(
        index=index, sample=sample, worker=worker, finished=Finished(FinishReason.LENGTH, Usage(0, generated))
    )
