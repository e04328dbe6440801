"""Validating a whole BatchGenerateRequest before anything is written."""

from __future__ import annotations

import pytest

from llamamesh.errors import InvalidRequest, NotFound
from llamamesh.settings import BatchSettings, GatewaySettings
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import generation_pb2 as pb
from services.batch import DEFAULT_TEMPLATE, batch_requests
from services.batch_requests import stored_size

pytestmark = pytest.mark.timeout(10)

GW = GatewaySettings(models="tiny=cpu,big=gpu", default_max_tokens=16)
MODELS = GW.model_table()


def fields(request: bpb.BatchGenerateRequest, b: BatchSettings | None = None) -> list[str]:
    with pytest.raises(InvalidRequest) as exc:
        batch_requests(request, GW, b or BatchSettings(), MODELS)
    return [v.field for v in exc.value.violations]


def item(cid: str, **kw: object) -> bpb.BatchItem:
    return bpb.BatchItem(custom_id=cid, request=pb.GenerateRequest(**{"prompt": "hi", **kw}))  # type: ignore[arg-type]


def test_items_become_jobs_of_the_batch() -> None:
    batch_id, window, items = batch_requests(
        bpb.BatchGenerateRequest(batch_id="b1", items=[item("a"), item("b", max_tokens=3)]), GW, BatchSettings(), MODELS
    )
    assert (batch_id, window) == ("b1", 86400)
    assert [(m.id, r.custom_id, r.batch_id, r.request_id) for m, r in items] == [
        ("tiny", "a", "b1", "b~b1~0"),
        ("tiny", "b", "b1", "b~b1~1"),
    ]
    assert items[1][1].sampling.max_tokens == 3 and items[0][1].sampling.max_tokens == 16


def test_summarise_fills_the_template() -> None:
    req = bpb.BatchGenerateRequest(
        summarise=bpb.Summarise(
            documents=[bpb.Document(custom_id="d", text="the text")], params=pb.GenerateRequest(max_tokens=5)
        )
    )
    batch_id, _w, items = batch_requests(req, GW, BatchSettings(), MODELS)
    assert batch_id  # made up when not given
    ((_m, r),) = items
    assert r.messages is not None and r.messages[0].content == DEFAULT_TEMPLATE.replace("{document}", "the text")


def test_every_bad_field_is_named_and_nothing_passes() -> None:
    assert fields(bpb.BatchGenerateRequest(items=[item("a"), item("b"), item("a")])) == ["items[2].custom_id"]
    assert fields(bpb.BatchGenerateRequest(items=[item("")])) == ["items[0].custom_id"]
    assert fields(bpb.BatchGenerateRequest()) == ["items"]
    assert fields(bpb.BatchGenerateRequest(items=[item("a", temperature=-1)])) == ["items[0].request.temperature"]
    assert fields(bpb.BatchGenerateRequest(items=[item("a"), item("b", model="big")])) == ["items[1].request.model"]
    assert fields(bpb.BatchGenerateRequest(batch_id="no spaces", items=[item("a")])) == ["batch_id"]
    assert fields(bpb.BatchGenerateRequest(items=[item("a")], completion_window_s=3)) == ["completion_window_s"]
    both = bpb.BatchGenerateRequest(
        items=[item("a")], summarise=bpb.Summarise(documents=[bpb.Document(custom_id="d", text="t")])
    )
    assert fields(both) == ["items"]
    summ = bpb.Summarise(
        template="no placeholder",
        params=pb.GenerateRequest(prompt="x"),
        documents=[bpb.Document(custom_id="d", text=" ")],
    )
    assert fields(bpb.BatchGenerateRequest(summarise=summ)) == [
        "summarise.template",
        "summarise.params",
        "summarise.documents[0].text",
    ]
    # a summarisation's shared parameters are named once, under summarise.params
    shared = bpb.Summarise(
        params=pb.GenerateRequest(temperature=-1, response_format=pb.ResponseFormat(regex="a(")),
        documents=[bpb.Document(custom_id=f"d{i}", text="t") for i in range(3)],
    )
    assert fields(bpb.BatchGenerateRequest(summarise=shared)) == [
        "summarise.params.temperature",
        "summarise.params.response_format.regex",
    ]
    many = bpb.BatchGenerateRequest(items=[item(str(i)) for i in range(3)])
    for bound, setting in (
        (BatchSettings(max_items=2), "LLAMAMESH_BATCH_MAX_ITEMS"),
        (BatchSettings(max_bytes=10), "LLAMAMESH_BATCH_MAX_BYTES"),
    ):
        with pytest.raises(InvalidRequest) as exc:
            batch_requests(many, GW, bound, MODELS)
        assert [(v.field, setting in v.description) for v in exc.value.violations] == [("items", True)]


def test_a_summarisation_counts_its_template_written_out_for_each_document() -> None:
    """A long template over many short documents is as many bytes as the items it makes: refused
    over LLAMAMESH_BATCH_MAX_BYTES before they are written out (it costs the gateway no memory)."""
    template = "x" * 100_000 + " {document}"
    docs = [bpb.Document(custom_id=f"d{i}", text="abc") for i in range(2000)]
    r = bpb.BatchGenerateRequest(
        summarise=bpb.Summarise(template=template, params=pb.GenerateRequest(), documents=docs)
    )
    assert r.ByteSize() < 200_000 and stored_size(r) > 2000 * 100_000
    with pytest.raises(InvalidRequest) as exc:
        batch_requests(r, GW, BatchSettings(max_bytes=64 * 1024 * 1024), MODELS)
    (v,) = exc.value.violations
    assert v.field == "summarise.documents" and "template written out" in v.description
    _, _, items = batch_requests(
        bpb.BatchGenerateRequest(summarise=bpb.Summarise(template=template, documents=docs[:3])),
        GW,
        BatchSettings(),
        MODELS,
    )
    made = sum(len(req.messages[0].content.encode()) for _m, req in items)
    assert made <= stored_size(bpb.BatchGenerateRequest(summarise=bpb.Summarise(template=template, documents=docs[:3])))


def test_an_unknown_model_is_not_found_naming_the_item() -> None:
    with pytest.raises(NotFound) as exc:
        batch_requests(
            bpb.BatchGenerateRequest(items=[item("a"), item("b", model="nope")]), GW, BatchSettings(), MODELS
        )
    assert exc.value.message.startswith("items[1] ('b'): ")


def test_the_batchs_labels_are_bounded_as_a_requests() -> None:
    def labelled(**meta: str) -> bpb.BatchGenerateRequest:
        return bpb.BatchGenerateRequest(items=[item("a")], metadata=meta)

    assert fields(labelled(k="v" * 513)) == ["metadata[k]"]
    assert fields(labelled(**{f"k{i}": "v" for i in range(65)})) == ["metadata"]
    assert fields(labelled(**{"k" * 65: "v"})) == ["metadata"]
    batch_requests(labelled(k="v" * 512), GW, BatchSettings(), MODELS)
