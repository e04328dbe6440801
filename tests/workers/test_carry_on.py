"""How a reclaimed job a dead worker had begun goes on from what its event stream holds."""

from __future__ import annotations

from types import MappingProxyType

from llamamesh.types import Failure, Finished, FinishReason, GenerationRequest, JobEvent, SamplingParams, Usage
from workers.carry_on import carried


def req(max_tokens: int | None = 8, n: int = 1, **kw: object) -> GenerationRequest:
    return GenerationRequest("r", "m", prompt="p", sampling=SamplingParams(max_tokens=max_tokens, n=n), **kw)  # type: ignore[arg-type]


def ev(index: int, *ids: int, sample: int = 0, end: FinishReason | None = None) -> JobEvent:
    return JobEvent(token_ids=ids, index=index, sample=sample, sample_end=end)


def test_one_sample_goes_on_from_its_tokens_with_the_rest_of_its_budget() -> None:
    c = carried(req(8), [ev(0, 10, 11), ev(2, 12)], "w2")
    assert c is not None and c.done is None and not c.ends
    assert c.request.resume_token_ids == (10, 11, 12) and c.request.sampling.max_tokens == 5
    assert dict(c.next_index) == {0: 3} and c.generated == 3


def test_a_repeat_a_retried_publish_wrote_is_read_once() -> None:
    c = carried(req(8), [ev(0, 10, 11), ev(0, 10, 11), ev(1, 11, 12)], "w2")
    assert c is not None and c.request.resume_token_ids == (10, 11, 12) and dict(c.next_index) == {0: 3}


def test_an_attempt_of_a_failed_over_request_keeps_the_tokens_it_was_resumed_from() -> None:
    """Its stream numbers from 0 after the tokens the gateway resumed it from."""
    attempt = req(5, resume_token_ids=(1, 2, 3))
    c = carried(attempt, [ev(0, 4, 5)], "w2")
    assert c is not None and c.request.resume_token_ids == (1, 2, 3, 4, 5) and c.request.sampling.max_tokens == 3
    assert dict(c.next_index) == {0: 2}


def test_a_whole_budget_on_the_stream_ends_length_without_running() -> None:
    c = carried(req(2), [ev(0, 10, 11)], "w2")
    assert c is not None and c.done is not None
    assert c.done.finished == Finished(FinishReason.LENGTH, Usage(0, 2)) and c.done.index == 2


def test_an_ended_stream_or_a_gap_is_not_carried_on() -> None:
    assert carried(req(), [ev(0, 1), ev(2, 3)], "w2") is None  # a gap
    failed = JobEvent(failed=Failure(code="internal", message="x"))
    assert carried(req(), [ev(0, 1), failed], "w2") is None
    done = JobEvent(index=1, finished=Finished(FinishReason.STOP, Usage(1, 1)))
    assert carried(req(), [ev(0, 1), done], "w2") is None


def test_several_samples_each_go_on_and_the_ended_ones_stay_ended() -> None:
    begun = [ev(0, 1, 2, sample=0), ev(0, 5, sample=1), ev(1, 6, sample=1, end=FinishReason.STOP), ev(0, 9, sample=2)]
    c = carried(req(4, n=3), begun, "w2")
    assert c is not None and c.done is None and not c.ends
    assert dict(c.request.resume_samples) == {0: (1, 2), 2: (9,)}
    assert dict(c.next_index) == {0: 2, 2: 1} and c.generated == 5


def test_a_sample_whose_budget_is_spent_ends_length_and_the_last_carries_the_terminal_event() -> None:
    c = carried(req(2, n=2), [ev(0, 1, 2, sample=0), ev(0, 5, sample=1)], "w2")
    assert c is not None and dict(c.request.resume_samples) == {1: (5,)}
    assert c.ends == (JobEvent(index=2, sample=0, sample_end=FinishReason.LENGTH, worker="w2"),)
    both = carried(req(1, n=2), [ev(0, 1, sample=0), ev(0, 5, sample=1)], "w2")
    assert both is not None and both.done is not None and both.done.sample == 1
    assert both.ends == (JobEvent(index=1, sample=0, sample_end=FinishReason.LENGTH, worker="w2"),)
    assert both.done.finished is not None and both.done.finished.usage.completion_tokens == 2


def test_an_attempt_of_several_samples_goes_on_with_those_it_was_resumed_for() -> None:
    attempt = req(4, n=3, resume_samples=MappingProxyType({0: (1,), 2: ()}))
    c = carried(attempt, [ev(0, 2, sample=0), ev(0, 7, sample=2)], "w2")
    assert c is not None and dict(c.request.resume_samples) == {0: (1, 2), 2: (7,)}
    assert dict(c.next_index) == {0: 1, 2: 1}


def test_a_hand_back_is_passed_over_and_what_came_before_it_counts() -> None:
    c = carried(req(8), [ev(0, 10, 11), JobEvent(worker="w1", handed_back=True)], "w2")
    assert c is not None and c.request.resume_token_ids == (10, 11) and dict(c.next_index) == {0: 2}
