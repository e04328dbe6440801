"""Prompt normalisation rules (services/normalize.py): parsing, each rule's reach, the counter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from llamamesh.types import ChatMessage, GenerationRequest, JobKind, affinity_key
from services.normalize import Normalizer

pytestmark = pytest.mark.timeout(10)

HTML_IDS = {"name": "html-ids", "pattern": 'id="[a-z0-9-]+"', "replacement": 'id="REDACTED"'}
TABLE = '<table><tr id="r-7f3a9c"><td id="c-01b2">x</td></tr></table>'


def rules(*objs: dict) -> Normalizer:
    return Normalizer.parse(json.dumps(list(objs)))


def prompt(text: str) -> GenerationRequest:
    return GenerationRequest(request_id="r", model="m", prompt=text)


def chat(*turns: tuple[str, str]) -> GenerationRequest:
    return GenerationRequest(request_id="r", model="m", messages=tuple(ChatMessage(r, c) for r, c in turns))


def rewrites(rule: str) -> float:
    return REGISTRY.get_sample_value("llamamesh_prompt_rewrites_total", {"rule": rule}) or 0.0


def test_the_html_id_rule_redacts_every_id_in_a_prompt() -> None:
    out = rules(HTML_IDS).apply(prompt(f"Summarise this table.\n{TABLE}"))
    assert out.prompt == 'Summarise this table.\n<table><tr id="REDACTED"><td id="REDACTED">x</td></tr></table>'


def test_no_rules_leave_the_request_itself() -> None:
    req = prompt(TABLE)
    for empty in (Normalizer(), Normalizer.parse(""), Normalizer.parse("  "), Normalizer.parse("[]")):
        assert not empty
        assert empty.apply(req) is req


def test_a_rule_that_matches_nothing_leaves_the_request_itself() -> None:
    req = chat(("user", "no ids here"))
    assert rules(HTML_IDS).apply(req) is req


def test_rules_run_in_order_each_on_what_the_last_left() -> None:
    n = rules(
        {"name": "ids", "pattern": 'id="[a-z0-9-]+"', "replacement": 'id="X"'},
        {"name": "x-to-y", "pattern": 'id="X"', "replacement": 'key="Y"'},
        {"name": "spaces", "pattern": r"[ \t]+", "replacement": " "},
    )
    assert n.apply(prompt('a  \t<tr id="r-1">')).prompt == 'a <tr key="Y">'
    swapped = rules(
        {"name": "x-to-y", "pattern": 'id="X"', "replacement": 'key="Y"'},
        {"name": "ids", "pattern": 'id="[a-z0-9-]+"', "replacement": 'id="X"'},
    )
    assert swapped.apply(prompt('<tr id="r-1">')).prompt == '<tr id="X">'


def test_a_rule_for_messages_of_some_roles_leaves_the_others_and_prompts() -> None:
    n = rules({**HTML_IDS, "applies_to": "messages", "roles": ["user", "tool"]})
    req = chat(("system", 'keep id="s-1"'), ("user", TABLE), ("assistant", 'keep id="a-1"'), ("tool", 'id="t-1"'))
    out = n.apply(req)
    assert out.messages == (
        ChatMessage("system", 'keep id="s-1"'),
        ChatMessage("user", '<table><tr id="REDACTED"><td id="REDACTED">x</td></tr></table>'),
        ChatMessage("assistant", 'keep id="a-1"'),
        ChatMessage("tool", 'id="REDACTED"'),
    )
    assert out.request_id == req.request_id and out.sampling == req.sampling
    assert n.apply(prompt(TABLE)).prompt == TABLE  # messages only


def test_a_prompt_rule_leaves_messages_and_all_takes_both() -> None:
    only_prompt = rules({**HTML_IDS, "applies_to": "prompt"})
    assert only_prompt.apply(prompt('id="a"')).prompt == 'id="REDACTED"'
    assert only_prompt.apply(chat(("user", 'id="a"'))).messages == (ChatMessage("user", 'id="a"'),)
    both = rules(HTML_IDS)
    assert both.apply(chat(("system", 'id="a"'))).messages == (ChatMessage("system", 'id="REDACTED"'),)


def test_flags_and_group_references() -> None:
    n = rules({"name": "uuid", "pattern": r"(uuid=)[0-9a-f-]{36}", "replacement": r"\1-", "flags": "i"})
    assert n.apply(prompt("UUID=123E4567-E89B-12D3-A456-426614174000 end")).prompt == "UUID=- end"


def test_tokenize_requests_are_rewritten_alike() -> None:
    req = GenerationRequest(request_id="t~1", model="m", prompt=TABLE, kind=JobKind.TOKENIZE)
    out = rules(HTML_IDS).apply(req)
    assert out.kind is JobKind.TOKENIZE and out.prompt == rules(HTML_IDS).apply(prompt(TABLE)).prompt


def test_the_counter_counts_requests_each_rule_changed() -> None:
    n = rules(
        {"name": "count-ids", "pattern": 'id="[a-z0-9-]+"', "replacement": 'id="REDACTED"'},
        {"name": "count-never", "pattern": "never-there", "replacement": ""},
    )
    before, never = rewrites("count-ids"), rewrites("count-never")
    n.apply(prompt(TABLE))  # two ids, one request
    n.apply(chat(("user", 'id="a"'), ("user", 'id="b"')))
    n.apply(prompt('id="REDACTED"'))  # matched, but nothing changed
    n.apply(prompt("nothing"))
    assert rewrites("count-ids") == before + 2
    assert rewrites("count-never") == never


def test_rules_come_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "rules.json"
    path.write_text(json.dumps([HTML_IDS]))
    assert Normalizer.parse(str(path)).apply(prompt('id="q"')).prompt == 'id="REDACTED"'
    with pytest.raises(ValueError, match="LLAMAMESH_GATEWAY_NORMALIZE_RULES: cannot read"):
        Normalizer.parse(str(tmp_path / "missing.json"))


BAD = [
    ("[", "the inline value is not JSON"),
    ('{"name": "x"}', "expected a JSON list"),
    ("[1]", "rule 1: expected a JSON object"),
    (json.dumps([{"pattern": "a", "replacement": ""}]), 'rule 1: "name" is required'),
    (json.dumps([HTML_IDS, {"name": "bad name", "pattern": "a", "replacement": ""}]), 'rule 2: "name" is required'),
    (json.dumps([HTML_IDS, {**HTML_IDS, "pattern": "b"}]), "rule 'html-ids': duplicate name \\(rules 1 and 2\\)"),
    (json.dumps([{**HTML_IDS, "pattern": "id=[a-z"}]), "rule 'html-ids': pattern does not compile: unterminated"),
    (json.dumps([{**HTML_IDS, "pattern": ""}]), "rule 'html-ids': \"pattern\" is required"),
    (json.dumps([{**HTML_IDS, "pattern": "x*"}]), "rule 'html-ids': pattern matches the empty string"),
    (json.dumps([{"name": "r", "pattern": "a"}]), "rule 'r': \"replacement\" is required"),
    (json.dumps([{"name": "r", "pattern": "(a)", "replacement": r"\2"}]), "rule 'r': replacement is not valid"),
    (json.dumps([{"name": "r", "pattern": "a", "replacement": r"\q"}]), "rule 'r': replacement is not valid"),
    (json.dumps([{**HTML_IDS, "flags": "iz"}]), "rule 'html-ids': \"flags\" must be letters of aimsx"),
    (json.dumps([{**HTML_IDS, "applies_to": "metadata"}]), "rule 'html-ids': \"applies_to\" must be one of"),
    (json.dumps([{**HTML_IDS, "roles": ["user"]}]), 'rule \'html-ids\': "roles" needs "applies_to": "messages"'),
    (json.dumps([{**HTML_IDS, "applies_to": "messages", "roles": ["wizard"]}]), "rule 'html-ids': \"roles\" must be"),
    (json.dumps([{**HTML_IDS, "replace": "x"}]), "rule 'html-ids': unknown key 'replace'"),
]


@pytest.mark.parametrize(("text", "message"), BAD)
def test_invalid_rules_fail_in_one_line_naming_the_rule(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"^LLAMAMESH_GATEWAY_NORMALIZE_RULES: .*{message}") as exc:
        Normalizer.parse(text)
    assert "\n" not in str(exc.value)


def test_a_rules_file_that_is_not_json_is_named(tmp_path: Path) -> None:
    path = tmp_path / "rules.json"
    path.write_text("name: html-ids\n")
    with pytest.raises(ValueError, match=f"^LLAMAMESH_GATEWAY_NORMALIZE_RULES: '{path}' is not JSON"):
        Normalizer.parse(str(path))


def test_a_prefix_key_hashed_from_the_input_is_hashed_again_from_the_rewritten_input() -> None:
    """Routing (prefix affinity) must see what the engine's cache sees: two prompts that differ only
    in ids the rule redacts get one key; a key the caller chose is left alone."""
    norm = Normalizer.parse('[{"name": "ids", "pattern": "id=\\"[a-z0-9-]+\\"", "replacement": "id=\\"X\\""}]', 64)
    a, b = ('<td id="a1-b2">doc one</td>', '<td id="c3-d4">doc one</td>')
    ra, rb = (
        GenerationRequest(request_id=p, model="m", prompt=p, prefix_key=affinity_key(p, None, 64)) for p in (a, b)
    )
    assert ra.prefix_key != rb.prefix_key
    na, nb = norm.apply(ra), norm.apply(rb)
    assert na.prefix_key == nb.prefix_key == affinity_key('<td id="X">doc one</td>', None, 64)
    mine = GenerationRequest(request_id="m", model="m", prompt=a, prefix_key="conversation-7")
    assert norm.apply(mine).prefix_key == "conversation-7"
