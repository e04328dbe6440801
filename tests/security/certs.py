"""Test certificates made with the ``openssl`` command: CAs, a server certificate for 127.0.0.1 and
localhost, client certificates. Each file is PEM; nothing here is meant for anything but tests."""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

# Loopback names every server certificate here is valid for (its subjectAltName).
SERVER_SAN = "IP:127.0.0.1,IP:::1,DNS:localhost"


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class CA:
    name: str
    cert: Path
    key: Path


def _openssl(*args: str | Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=30)


def make_ca(folder: Path, name: str) -> CA:
    """A self-signed CA called ``name`` (its files: ``<name>.crt``, ``<name>.key``)."""
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        key,
        "-out",
        cert,
        "-days",
        "2",
        "-subj",
        f"/CN={name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    return CA(name, cert, key)


def issue(ca: CA, folder: Path, name: str, cn: str, server: bool) -> Pair:
    """A certificate for ``cn`` signed by ``ca``: a server's (valid for SERVER_SAN) or a client's
    (``cn`` also as a DNS subjectAltName). Files ``<name>.crt`` / ``<name>.key``; each call a new
    key and serial, so issuing ``name`` again replaces the pair."""
    folder.mkdir(parents=True, exist_ok=True)
    cert, key, csr, ext = (folder / f"{name}{s}" for s in (".crt", ".key", ".csr", ".ext"))
    san = SERVER_SAN if server else f"DNS:{cn}"
    usage = "serverAuth" if server else "clientAuth"
    ext.write_text(f"subjectAltName={san}\nextendedKeyUsage={usage}\nbasicConstraints=CA:FALSE\n")
    _openssl(
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        key,
        "-out",
        csr,
        "-subj",
        f"/CN={cn}",
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        csr,
        "-CA",
        ca.cert,
        "-CAkey",
        ca.key,
        "-set_serial",
        str(secrets.randbits(63) | 1),
        "-days",
        "2",
        "-out",
        cert,
        "-extfile",
        ext,
    )
    csr.unlink()
    ext.unlink()
    return Pair(cert, key)
