"""Response constraints: the checks every side shares, their trip through the job codec, and the
arguments each GPU library gets (vLLM's StructuredOutputsParams, TensorRT-LLM's GuidedDecodingParams)."""

from __future__ import annotations

import json
import re

import pytest

from llamamesh import sampling
from llamamesh.errors import InvalidRequest, Unavailable
from llamamesh.queue import codec
from llamamesh.types import ConstraintKind, GenerationRequest, ResponseConstraint, SamplingParams
from workers.engines.constraints import (
    Grammars,
    choice_grammar,
    constraint_error,
    library_constraint,
    trtllm_guided,
    vllm_structured,
)

pytestmark = pytest.mark.timeout(30)

LONG = "x" * (sampling.MAX_CONSTRAINT_CHARS + 1)

SCHEMA = ResponseConstraint(ConstraintKind.JSON_SCHEMA, text='{"type": "object"}')
EVERY = [
    SCHEMA,
    ResponseConstraint(ConstraintKind.JSON_OBJECT),
    ResponseConstraint(ConstraintKind.REGEX, text=r"[a-z]+"),
    ResponseConstraint(ConstraintKind.CHOICE, options=("yes", 'say "no"')),
    ResponseConstraint(ConstraintKind.GRAMMAR, text='root ::= "a"'),
]


@pytest.mark.parametrize("constraint", [*EVERY, None])
def test_a_constraint_travels_through_the_job_codec_unchanged(constraint: ResponseConstraint | None) -> None:
    req = GenerationRequest(request_id="r", model="m", prompt="p", sampling=SamplingParams(constraint=constraint))
    assert codec.decode_job(codec.encode_job(req)).sampling.constraint == constraint


# A schema nested 65 deep, well inside the 64-KiB bound; and one nested past Python's own stack.
DEEP = '{"items": ' * 64 + "{}" + "}" * 64
PAST_STACK = '{"a": ' * 5000 + "1" + "}" * 5000


@pytest.mark.parametrize(
    ("constraint", "field", "why"),
    [
        (ResponseConstraint(ConstraintKind.JSON_SCHEMA, text="{nope"), "response_format.json_schema", "not JSON"),
        (ResponseConstraint(ConstraintKind.JSON_SCHEMA, text="[1]"), "response_format.json_schema", "object"),
        (ResponseConstraint(ConstraintKind.JSON_SCHEMA, text=" "), "response_format.json_schema", "empty"),
        (ResponseConstraint(ConstraintKind.REGEX, text="a(b"), "response_format.regex", "regular expression"),
        (ResponseConstraint(ConstraintKind.CHOICE), "response_format.choice", "at least one"),
        (ResponseConstraint(ConstraintKind.CHOICE, options=("a", "")), "response_format.choice", "empty"),
        (ResponseConstraint(ConstraintKind.GRAMMAR, text="just words"), "response_format.grammar", "root"),
        (ResponseConstraint(ConstraintKind.GRAMMAR, text=LONG), "response_format.grammar", "at most"),
        (ResponseConstraint(ConstraintKind.JSON_SCHEMA, text=DEEP), "response_format.json_schema", "at most 64 deep"),
        (ResponseConstraint(ConstraintKind.JSON_SCHEMA, text=PAST_STACK), "response_format.json_schema", "not JSON"),
    ],
)
def test_what_needs_no_engine_is_refused_naming_the_field(constraint: ResponseConstraint, field: str, why: str) -> None:
    (v,) = sampling.violations(SamplingParams(constraint=constraint))
    assert v.field == field and why in v.description


def test_a_schema_as_deep_as_allowed_passes_and_depth_counts_objects_and_lists() -> None:
    assert sampling.json_depth(1) == 0 and sampling.json_depth({"a": [1, {"b": []}]}) == 4
    ok = '{"items": ' * 63 + "{}" + "}" * 63
    assert sampling.violations(SamplingParams(constraint=ResponseConstraint(ConstraintKind.JSON_SCHEMA, text=ok))) == []


def test_a_constraint_excludes_ignore_eos_and_min_tokens() -> None:
    found = sampling.violations(SamplingParams(constraint=SCHEMA, ignore_eos=True, min_tokens=2, max_tokens=8))
    assert {v.field for v in found} == {"ignore_eos", "min_tokens"}
    assert sampling.violations(SamplingParams(constraint=SCHEMA, ignore_eos=False, min_tokens=0)) == []


def test_vllm_gets_its_structured_outputs_fields() -> None:
    assert [vllm_structured(c) for c in EVERY] == [
        {"json": '{"type": "object"}', "disable_any_whitespace": True},
        {"json_object": True, "disable_any_whitespace": True},
        {"regex": "[a-z]+"},
        {"choice": ["yes", 'say "no"']},
        {"grammar": 'root ::= "a"'},
    ]


def test_tensorrt_llm_gets_guided_decoding_fields_and_a_choice_as_a_grammar() -> None:
    assert [trtllm_guided(c) for c in EVERY] == [
        {"json": '{"type": "object"}'},
        {"json_object": True},
        {"regex": "[a-z]+"},
        {"grammar": 'root ::= "yes" | "say \\"no\\""'},
        {"grammar": 'root ::= "a"'},
    ]


def test_a_choice_grammar_accepts_exactly_its_options() -> None:
    """Through xgrammar's own grammar parser: each option (quotes, backslashes, non-ASCII) and
    nothing else, with no tokenizer involved."""
    xgr = pytest.importorskip("xgrammar")
    options = ["plain", 'a "quoted" one', "back\\slash", "naïve ✓", "two\nlines"]
    grammar = xgr.Grammar.from_ebnf(choice_grammar(options))
    for o in options:
        assert xgr.testing._is_grammar_accept_string(grammar, o), o
    for other in ["plai", "plainx", 'a "quoted"', ""]:
        assert not xgr.testing._is_grammar_accept_string(grammar, other), other


def test_a_library_error_about_the_constraint_names_its_field() -> None:
    err = constraint_error("Error in grammar: expected ::=", SCHEMA)
    assert isinstance(err, InvalidRequest) and err.violations[0].field == "response_format.json_schema"
    assert constraint_error("top_p must be in (0, 1]", None) is None
    assert constraint_error("prompt too long", SCHEMA) is None


def test_a_gpu_library_refuses_to_resume_a_constrained_request() -> None:
    """vLLM and TensorRT-LLM start the grammar at the first generated token: a resume would restart it."""
    fresh = GenerationRequest(request_id="r", model="m", prompt="p", sampling=SamplingParams(constraint=SCHEMA))
    assert library_constraint(fresh, "vLLM") == SCHEMA
    with pytest.raises(Unavailable, match="vLLM cannot resume"):
        library_constraint(
            GenerationRequest(
                request_id="r",
                model="m",
                prompt="p",
                resume_token_ids=(1, 2),
                sampling=SamplingParams(constraint=SCHEMA),
            ),
            "vLLM",
        )
    free = GenerationRequest(request_id="r", model="m", prompt="p", resume_token_ids=(1,))
    assert library_constraint(free, "vLLM") is None


def test_xgrammar_compile_errors_are_invalid_naming_the_field_without_its_source_location() -> None:
    pytest.importorskip("xgrammar")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"a": 0, "b": 1, "</s>": 2}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="a")), eos_token="</s>")
    grammars = Grammars(tok, vocab_size=3, stop_token_ids=[2])
    assert grammars.matcher(ResponseConstraint(ConstraintKind.REGEX, text="(ab)+")) is not None
    with pytest.raises(InvalidRequest) as err:
        grammars.matcher(ResponseConstraint(ConstraintKind.GRAMMAR, text="root ::= missing"))
    v = err.value.violations[0]
    assert v.field == "response_format.grammar" and not re.search(r"\.cc:\d+", v.description)
    assert json.dumps(v.description)  # plain text


def test_the_python_client_builds_one_response_format_from_keywords() -> None:
    from llamamesh.client import build_request

    req = build_request("p", json_schema={"type": "object"}, max_tokens=8)
    assert req.response_format.json_schema == '{"type": "object"}' and req.max_tokens == 8
    assert build_request("p", json_schema='{"type": "string"}').response_format.json_schema == '{"type": "string"}'
    assert list(build_request("p", choice=["a", "b"]).response_format.choice.options) == ["a", "b"]
    assert build_request("p", json_object=True).response_format.json_object
    assert build_request("p", regex="x+").response_format.regex == "x+"
    assert build_request("p", grammar='root ::= "a"').response_format.grammar == 'root ::= "a"'
    assert not build_request("p").HasField("response_format")
    with pytest.raises(ValueError, match="one response format"):
        build_request("p", regex="x", choice=["a"])
    with pytest.raises(TypeError, match="messages="):  # messages where the prompt goes: said so
        build_request([("user", "hi")], json_object=True)  # type: ignore[arg-type]
