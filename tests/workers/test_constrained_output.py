"""Constrained decoding (response_format) on the CPU engine with the real SmolLM2-135M-Instruct:
every output follows its JSON schema, regex, choice or grammar, sampled or greedy, alone or batched,
and across a mid-stream resume."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import AsyncIterator
from dataclasses import replace

import jsonschema
import pytest
import pytest_asyncio

from llamamesh.errors import InvalidRequest
from llamamesh.types import ConstraintKind, FinishReason, ResponseConstraint
from tests.workers.test_transformers_engine import chat, collect, run, started
from workers.engines.transformers import TransformersEngine

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def schema(s: dict) -> ResponseConstraint:
    return ResponseConstraint(ConstraintKind.JSON_SCHEMA, text=json.dumps(s))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[TransformersEngine]:
    async for eng in started(max_inflight=8):
        yield eng


async def test_every_sampled_output_validates_against_its_json_schema(engine: TransformersEngine) -> None:
    """Eight sampled requests at once (one batch): each one JSON value that validates, ended by the
    model's end of sequence once the value is complete."""
    asks = [
        chat(f"Describe person number {i} as JSON.", temperature=1.0, seed=i, max_tokens=80, constraint=schema(PERSON))
        for i in range(8)
    ]
    results = await asyncio.gather(*(run(engine, r) for r in asks))
    for res in results:
        jsonschema.validate(json.loads(res.text), PERSON)
        assert res.last.finish_reason is FinishReason.STOP
    assert len({r.text for r in results}) > 1  # sampled, not one forced string


async def test_greedy_json_object_regex_and_choice_hold(engine: TransformersEngine) -> None:
    ask = 'Reply with a JSON object with one key "answer": what is 2+2?'
    any_object = ResponseConstraint(ConstraintKind.JSON_OBJECT)
    obj = await run(engine, chat(ask, temperature=0, max_tokens=60, constraint=any_object))
    assert isinstance(json.loads(obj.text), dict) and obj.last.finish_reason is FinishReason.STOP
    iso = ResponseConstraint(ConstraintKind.REGEX, text=r"\d{4}-\d{2}-\d{2}")
    date = await run(
        engine, chat("When did the Berlin wall fall?", temperature=0.8, seed=3, max_tokens=20, constraint=iso)
    )
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date.text), date.text
    options = ("positive", "negative", "neutral")
    pick = ResponseConstraint(ConstraintKind.CHOICE, options=options)
    for seed in range(3):
        label = await run(
            engine, chat("I love this film! Sentiment?", temperature=1.0, seed=seed, max_tokens=10, constraint=pick)
        )
        assert label.text in options and label.last.finish_reason is FinishReason.STOP


async def test_an_ebnf_grammar_holds(engine: TransformersEngine) -> None:
    grammar = ResponseConstraint(ConstraintKind.GRAMMAR, text='root ::= "yes" | "no" | ("maybe, " [0-9] " in 10")')
    for seed in range(3):
        res = await run(engine, chat("Will it rain?", temperature=1.0, seed=seed, max_tokens=12, constraint=grammar))
        assert re.fullmatch(r"yes|no|maybe, [0-9] in 10", res.text), res.text


async def test_a_constraint_the_engine_cannot_compile_is_invalid_naming_the_field(engine: TransformersEngine) -> None:
    bad = [
        (ResponseConstraint(ConstraintKind.GRAMMAR, text="root ::= undefined_rule"), "response_format.grammar"),
        (ResponseConstraint(ConstraintKind.JSON_SCHEMA, text='{"type": 12}'), "response_format.json_schema"),
    ]
    for constraint, field in bad:
        with pytest.raises(InvalidRequest) as err:
            await run(engine, chat("hi", max_tokens=4, constraint=constraint))
        assert err.value.violations[0].field == field
    # and the engine goes on serving
    ok = await run(engine, chat("Describe a person as JSON.", temperature=0, max_tokens=80, constraint=schema(PERSON)))
    jsonschema.validate(json.loads(ok.text), PERSON)


async def test_a_resume_continues_the_grammar_from_the_tokens_already_sent(engine: TransformersEngine) -> None:
    """Mid-stream failover: the resumed tokens go through the grammar first, so the rest completes
    the same JSON value, not a second one."""
    first = chat("Describe a person as JSON.", temperature=0, max_tokens=80, constraint=schema(PERSON))
    whole = await run(engine, first)
    sent = whole.tokens[:7]
    rest = await run(
        engine,
        replace(
            first,
            request_id=first.request_id + "-2",
            resume_token_ids=tuple(sent),
            sampling=replace(first.sampling, max_tokens=80 - 7),
        ),
    )
    text = engine.tokenizer.decode(sent, skip_special_tokens=True) + rest.text
    jsonschema.validate(json.loads(text), PERSON)
    # resumed tokens that the grammar refuses are an invalid request, not a broken output
    with pytest.raises(InvalidRequest) as err:
        await run(
            engine,
            replace(
                first, request_id=first.request_id + "-3", resume_token_ids=tuple(engine.tokenizer.encode("hello"))
            ),
        )
    assert err.value.violations[0].field == "resume_token_ids"


async def test_a_request_aborted_while_its_grammar_compiles_never_runs(
    engine: TransformersEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel (or a deadline) can reach the engine while a large schema still compiles, before the
    request is entered: it ends CANCELLED without running, instead of generating its whole budget."""
    assert engine._batch is not None
    grammars = engine._batch.grammars
    compile_now, entered, go_on = grammars.matcher, threading.Event(), threading.Event()

    def slow(constraint: ResponseConstraint) -> object:
        entered.set()
        go_on.wait(10)
        return compile_now(constraint)

    monkeypatch.setattr(grammars, "matcher", slow)
    req = chat("Describe a person as JSON.", temperature=0, max_tokens=80, constraint=schema(PERSON))
    got: list = []
    reading = asyncio.create_task(collect(engine.stream(req), got))
    await asyncio.to_thread(entered.wait, 10)
    await engine.abort(req.request_id)
    go_on.set()
    await asyncio.wait_for(reading, 30)
    assert [(d.token_ids, d.finish_reason) for d in got] == [((), FinishReason.CANCELLED)]
