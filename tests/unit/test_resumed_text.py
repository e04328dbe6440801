"""A resumed stream carries exactly the text of the tokens it carries: events joined by a reader that
fell behind (``JobEvent.joined``) keep where each one's text ended, and the relay's cuts
(services/cursor.py ``cut``) split the text there, so that the text of a stream resumed any number of
times, from any offset a caller can hold, equals that of the stream never interrupted."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamamesh.queue.memory import MemoryQueue
from llamamesh.settings import GatewaySettings
from llamamesh.types import Attempt, Finished, FinishReason, JobEvent, Usage
from services.cursor import cut
from services.relay import QueueRelay

pytestmark = pytest.mark.timeout(60)

# One engine step: 1-3 tokens, a text that may be empty (a character still incomplete) or not ASCII.
steps = st.lists(st.tuples(st.integers(1, 3), st.text(alphabet="ab é漢🙂", max_size=4)), min_size=1, max_size=30)


def events_of(spec: list[tuple[int, str]], flush: str = "") -> list[JobEvent]:
    """The steps as a worker writes them, numbered, the last one terminal (with a final flush of text
    and no token of its own when ``flush``)."""
    out, at = [], 0
    for n, text in spec:
        out.append(JobEvent(text=text, token_ids=tuple(range(at, at + n)), index=at))
        at += n
    end = Finished(FinishReason.LENGTH, Usage(1, at))
    if flush:
        out.append(JobEvent(text=flush, index=at, finished=end))
    else:
        out[-1] = JobEvent(text=out[-1].text, token_ids=out[-1].token_ids, index=out[-1].index, finished=end)
    return out


def boundaries(events: list[JobEvent]) -> list[int]:
    return sorted({e.index + len(e.token_ids) for e in events} | {0})


@given(steps, st.text(alphabet="xé", max_size=2), st.data())
def test_a_joined_event_cut_at_any_step_boundary_splits_its_text_exactly(
    spec: list[tuple[int, str]], flush: str, data: st.DataObject
) -> None:
    events = events_of(spec, flush)
    joined = JobEvent.joined(events)
    assert joined.text == "".join(e.text for e in events) and joined.terminal
    k = data.draw(st.sampled_from(boundaries(events)))
    head, tail = cut(joined, 0, k), cut(joined, k, None)
    assert tail is not None
    # What a caller holding k tokens has is the text of the steps whose tokens it has.
    assert (head.text if head else "") == "".join(
        e.text for e in events if e.index + len(e.token_ids) <= k and e.token_ids
    )
    assert (head.text if head else "") + tail.text == joined.text
    assert tail.token_ids == joined.token_ids[k:] and tail.terminal


@given(st.integers(2, 6), st.text(min_size=1, max_size=5), st.data())
def test_a_cut_inside_one_steps_tokens_still_adds_up_to_its_text(n: int, text: str, data: st.DataObject) -> None:
    """A step of several tokens (speculative decoding) has one text: it goes with the step's last
    token, whichever side of a cut that is."""
    step = JobEvent(text=text, token_ids=tuple(range(n)), index=0)
    cuts = sorted(data.draw(st.lists(st.integers(1, n - 1), max_size=3, unique=True)))
    pieces = [cut(step, lo, hi) for lo, hi in zip([0, *cuts], [*cuts, None], strict=True)]
    assert "".join(p.text for p in pieces if p) == text
    assert tuple(t for p in pieces if p for t in p.token_ids) == step.token_ids


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps, st.data())
def test_attaching_again_and_again_yields_the_uninterrupted_text(
    spec: list[tuple[int, str]], data: st.DataObject
) -> None:
    """The worker writes its steps in bursts; the caller reads a few messages of each Attach, drops
    it, and attaches again from the count of tokens it has, until the stream ends."""
    events = events_of(spec)
    bursts = data.draw(st.lists(st.integers(1, 4), min_size=len(events), max_size=len(events)))
    reads = data.draw(st.lists(st.integers(1, 3), min_size=len(events) + 1, max_size=len(events) + 1))
    asyncio.run(_resume_until_done(events, bursts, reads))


async def _resume_until_done(events: list[JobEvent], bursts: list[int], reads: list[int]) -> None:
    queue = MemoryQueue()
    relay = QueueRelay(queue, GatewaySettings(port=0, reattach_grace_s=60))
    await queue.begin("r", Attempt("r", 0, "cpu", "tiny", 1, True), first=True)
    written = 0

    async def write(k: int) -> None:
        nonlocal written
        for ev in events[written : written + k]:
            await queue.end("r", ev)
        written = min(len(events), written + k)

    await write(bursts[0])
    ids: list[int] = []
    text = ""
    done = False
    for turn in range(len(events) + 1):
        stream = relay.attach("r", len(ids))
        try:
            for _ in range(reads[turn]):
                if written < len(events):
                    await write(bursts[turn])
                _head, ev = await asyncio.wait_for(anext(stream), 5)
                assert ev.index == len(ids) or not ev.token_ids
                ids += ev.token_ids
                text += ev.text
                if ev.terminal:
                    done = True
                    break
        finally:
            await stream.aclose()
        if done:
            break
    await relay.close()
    assert done
    assert ids == [t for e in events for t in e.token_ids]
    assert text == "".join(e.text for e in events)
