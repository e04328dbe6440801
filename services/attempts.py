"""The attempts of a relayed request: the job each next attempt runs (resumed from the tokens the
caller has), the ends of samples a lost attempt had spent, and the error a failure event carries.

An attempt after the first is a job of its own, ``<request id>~<n>`` ("~" is in no caller's id):
before any token it starts the request again; after tokens it feeds them after the input and
generates only the rest of the budget (n > 1: each unfinished sample from its own tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from types import MappingProxyType

from llamamesh import errors
from llamamesh.types import Finished, FinishReason, GenerationRequest, JobEvent, Usage
from services.cursor import SampleCursors


def resumed(req: GenerationRequest, n: int, sent: Sequence[int]) -> GenerationRequest:
    """Attempt ``n`` of ``req`` after ``sent`` tokens reached the caller: it feeds them after the
    input and generates only the rest of the budget."""
    attempt_id = f"{req.request_id}~{n}"  # "~" is in no caller id: the two never meet
    if not sent:
        return replace(req, request_id=attempt_id, origin_id=req.request_id)
    return replace(
        req,
        request_id=attempt_id,
        origin_id=req.request_id,
        resume_token_ids=tuple(sent),
        sampling=req.sampling.after(len(sent)),
    )


def resumed_samples(req: GenerationRequest, n: int, streams: SampleCursors) -> GenerationRequest:
    """Attempt ``n`` of a request of several samples: every sample that has not ended goes on from
    the tokens the caller has of it (the worker runs each on its own: workers/samples.py); with no
    token sent and none ended, the request starts again whole."""
    attempt_id = f"{req.request_id}~{n}"
    if not streams.total and not streams.ended:
        return replace(req, request_id=attempt_id, origin_id=req.request_id)
    todo = {k: tuple(c.sent) for k, c in streams.cursors.items() if k not in streams.ended}
    return replace(req, request_id=attempt_id, origin_id=req.request_id, resume_samples=MappingProxyType(todo))


def next_attempt(req: GenerationRequest, n: int, streams: SampleCursors) -> GenerationRequest:
    """The job of attempt ``n`` of ``req`` (0: the request itself), after what ``streams`` sent."""
    if n == 0:
        return req
    if streams.n > 1:
        return resumed_samples(req, n, streams)
    return resumed(req, n, streams.cursors[0].sent)


def spent_samples(req: GenerationRequest, streams: SampleCursors) -> list[JobEvent]:
    """The LENGTH ends of the samples whose whole max_tokens the caller has but whose end it did not
    get (their worker was lost after the last token); the last sample to end gets the terminal event,
    with every sample's tokens as usage."""
    most = req.sampling.max_tokens
    if most is None:
        return []
    spent = [k for k, c in streams.cursors.items() if k not in streams.ended and len(c.sent) >= most]
    live = streams.n - len(streams.ended) - len(spent)
    out = []
    for i, k in enumerate(spent):
        at = len(streams.cursors[k].sent)
        if live == 0 and i == len(spent) - 1:
            out.append(JobEvent(index=at, sample=k, finished=Finished(FinishReason.LENGTH, Usage(0, streams.total))))
        else:
            out.append(JobEvent(index=at, sample=k, sample_end=FinishReason.LENGTH))
    return out


def handed_back(ev: JobEvent) -> errors.WorkerLost:
    """What a hand-back (``JobEvent.handed_back``) means to the request's gateway: its worker gave it
    up, a death when its engine died under it (it counts against the gateway's max_worker_deaths)."""
    if ev.engine_died:
        return errors.WorkerLost(f"the engine of worker {ev.worker!r} died running the request", running=True)
    return errors.WorkerLost(f"worker {ev.worker!r} handed the request back")


def raise_failure(ev: JobEvent) -> None:
    """Raise the domain error a failure event carries (none for any other event)."""
    if ev.failed is not None:
        f = ev.failed
        raise errors.from_code(f.code, f.message, f.field)
