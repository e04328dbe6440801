"""The tenants file: parsing, keys (hashed, revocable), certificate identities, reloading."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import time
from pathlib import Path

import pytest
import structlog

from llamamesh import errors, tenants
from llamamesh.settings import LimitsSettings
from llamamesh.tenants import Tenants, TenantsFile, create_key, list_keys, revoke_key
from tests.waiting import until

pytestmark = pytest.mark.timeout(10)


def doc(**tenant_entries: dict[str, object]) -> dict[str, object]:
    return {"tenants": tenant_entries, "keys": {}}


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ([], "expected a JSON object"),
        (doc(**{"a/b": {}}), "tenant name 'a/b'"),
        (doc(a={"limits": {"requests_per_sec": 1}}), "tenants.a.limits.requests_per_sec is not a limit"),
        (doc(a={"limits": {"max_streams": "8"}}), "tenants.a.limits.max_streams must be a int"),
        (doc(a={"limits": {"max_streams": True}}), "must be a int"),
        (doc(a={"limits": {"pools": 3}}), "tenants.a.limits.pools must be a str"),
        (doc(a={"certificates": "cn"}), "certificates must be a list"),
        ({"tenants": {}, "keys": {"k": {"tenant": "nobody", "sha256": "00"}}}, "keys.k needs"),
    ],
)
def test_a_bad_file_is_refused_naming_what_is_wrong(document: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Tenants.parse(document, LimitsSettings())


def test_limits_override_the_defaults_field_by_field() -> None:
    t = Tenants.parse(doc(a={"limits": {"max_streams": 3, "requests_per_s": 2}}), LimitsSettings(max_priority=7))
    assert t.tenants["a"].limits == LimitsSettings(max_streams=3, requests_per_s=2.0, max_priority=7)


def test_keys_are_stored_hashed_and_authenticate_their_tenant(tmp_path: Path) -> None:
    path = str(tmp_path / "t.json")
    kid, key = create_key(path, "acme")
    _, admin_key = create_key(path, "ops", admin=True)
    text = Path(path).read_text()
    assert key not in text and key.split("_", 2)[2] not in text and kid in text
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    file = TenantsFile(path, LimitsSettings())
    who = file.current().authenticate(key)
    assert (who.tenant, who.key_id, who.via, who.admin) == ("acme", kid, "key", False)
    assert file.current().authenticate(admin_key).admin
    for bad in ("", "lm_nope", f"lm_{kid}_wrong-secret", key[:-1], "Bearer " + key, f"lm_000000000000_{key[-8:]}"):
        with pytest.raises(errors.Unauthenticated):
            file.current().authenticate(bad)
    listed = list_keys(path)
    assert {k["tenant"] for k in listed} == {"acme", "ops"} and kid in {k["key_id"] for k in listed}
    assert all("sha256" not in k for k in listed)
    with pytest.raises(FileNotFoundError):  # no file: said, not an empty list
        list_keys(str(tmp_path / "none.json"))
    (tmp_path / "odd.json").write_text('{"keys": 5}')
    with pytest.raises(ValueError, match="tenants file"):
        list_keys(str(tmp_path / "odd.json"))


def test_a_revoked_key_is_refused_after_the_next_reload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tenants, "RELOAD_EVERY_S", 0.0)
    path = str(tmp_path / "t.json")
    kid, key = create_key(path, "acme")
    file = TenantsFile(path, LimitsSettings())
    assert file.current().authenticate(key).tenant == "acme"
    revoke_key(path, kid)
    with pytest.raises(errors.Unauthenticated, match="revoked"):
        file.current().authenticate(key)
    with pytest.raises(KeyError):
        revoke_key(path, "unknown")


def test_a_file_turned_invalid_keeps_the_last_good_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tenants, "RELOAD_EVERY_S", 0.0)
    path = tmp_path / "t.json"
    _, key = create_key(str(path), "acme")
    file = TenantsFile(str(path), LimitsSettings())
    path.write_text("{not json")
    os.utime(path, (time.time() + 5, time.time() + 5))
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):  # looked at again each time, said once
            assert file.current().authenticate(key).tenant == "acme"
        assert "t.json" in file.last_error
        create_key(str(path.with_name("other.json")), "beta")
        os.replace(path.with_name("other.json"), path)  # a valid file again: taken
        assert file.current().tenants.keys() == {"beta"}
    said = [(e["event"], e["log_level"]) for e in logs]
    assert said == [("tenants_file_refused", "warning"), ("tenants_file_reloaded", "info")]
    path.write_text("{not json")
    with pytest.raises(ValueError, match="tenants file"):
        TenantsFile(str(path), LimitsSettings())  # a gateway does not start on a bad file


def test_certificates_map_to_tenants_and_a_bad_key_is_never_rescued_by_one() -> None:
    t = Tenants.parse(doc(acme={"certificates": ["acme-client"], "admin": True}), LimitsSettings())
    who = t.authenticate("", ("other-san", "acme-client"))
    assert (who.tenant, who.via, who.admin, who.key_id) == ("acme", "certificate", True, "cert:acme-client")
    with pytest.raises(errors.Unauthenticated, match="maps to no tenant"):
        t.authenticate("", ("stranger",))
    with pytest.raises(errors.Unauthenticated, match="invalid API key"):
        t.authenticate("lm_x_y", ("acme-client",))


def test_create_key_refuses_a_bad_tenant_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tenant name"):
        create_key(str(tmp_path / "t.json"), "no/slash")
    assert json.loads((tmp_path / "t.json").read_text() if (tmp_path / "t.json").exists() else "{}") == {}


def test_keys_are_added_to_a_file_with_null_parts_and_a_bad_one_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"tenants": {"acme": {"certificates": ["acme-client"]}}, "keys": None}))
    key_id, _ = create_key(str(path), "acme")
    revoke_key(str(path), key_id)
    assert [k["revoked"] for k in list_keys(str(path))] == [True]
    for bad, says in (({"tenants": ["acme"]}, "'tenants' must be an object"), ([1], "expected a JSON object")):
        path.write_text(json.dumps(bad))
        for edit in (lambda: create_key(str(path), "acme"), lambda: revoke_key(str(path), "x")):
            with pytest.raises(ValueError, match=says):
                edit()
        assert json.loads(path.read_text()) == bad  # left as it was


@pytest.mark.parametrize(
    ("limits", "named"),
    [
        ({"weight": 0}, "limits.weight=0.0"),
        ({"burst": -1}, "limits.burst=-1"),
        ({"nope": 1}, "limits.nope is not a limit"),
    ],
)
def test_a_limit_out_of_range_is_refused_naming_it_as_the_file_does(limits: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=f"tenants.acme.{named}"):
        Tenants.parse(doc(acme={"limits": limits}), LimitsSettings())


async def test_a_watched_file_is_taken_and_logged_with_no_request_to_look(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tenants, "RELOAD_EVERY_S", 0.01)
    path = tmp_path / "t.json"
    create_key(str(path), "acme")
    file = TenantsFile(str(path), LimitsSettings())
    with structlog.testing.capture_logs() as logs:
        watch = asyncio.create_task(file.watch())
        try:
            path.write_text("{not json")
            os.utime(path, (time.time() + 5, time.time() + 5))
            await until(lambda: [e for e in logs if e["event"] == "tenants_file_refused"], 5, "the refusal logged")
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
