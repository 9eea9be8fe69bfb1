"""Test certificates made with the openssl command: a CA, a server pair for 127.0.0.1 and a client pair it signed,
and a second CA with its own client pair (a client the server must refuse)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest


def make_pki_or_skip(d: Path) -> Pki:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make test certificates")
    return make_pki(d)


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_crt: Path
    server_key: Path
    client_crt: Path
    client_key: Path
    rogue_ca: Path
    rogue_crt: Path
    rogue_key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    crt, key = d / f"{name}.crt", d / f"{name}.key"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
        "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-keyout", str(key), "-out", str(crt),
    )  # fmt: skip
    return crt, key


def _leaf(d: Path, name: str, ca: tuple[Path, Path], cn: str, ext: str) -> tuple[Path, Path]:
    crt, key, csr, extfile = d / f"{name}.crt", d / f"{name}.key", d / f"{name}.csr", d / f"{name}.ext"
    extfile.write_text(ext)
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", f"/CN={cn}",
        "-keyout", str(key), "-out", str(csr),
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial", "-days", "2",
        "-extfile", str(extfile), "-out", str(crt),
    )  # fmt: skip
    return crt, key


def make_pki(d: Path, server_names: str = "IP:127.0.0.1,DNS:localhost") -> Pki:
    d.mkdir(parents=True, exist_ok=True)
    ca = _ca(d, "ca")
    server = _leaf(
        d, "server", ca, "sharegpu-extender", f"subjectAltName={server_names}\nextendedKeyUsage=serverAuth\n"
    )
    client = _leaf(d, "client", ca, "sharegpu-scheduler", "extendedKeyUsage=clientAuth\n")
    rogue_ca = _ca(d, "rogue-ca")
    rogue = _leaf(d, "rogue", rogue_ca, "sharegpu-scheduler", "extendedKeyUsage=clientAuth\n")
    return Pki(ca[0], *server, *client, rogue_ca[0], *rogue)


async def wait_answering(client: httpx2.AsyncClient, url: str) -> None:
    """Until a server started beside the test (its socket bound in a task of the same event loop) answers ``url``."""
    for _ in range(100):
        try:
            await client.get(url)
            return
        except httpx2.ConnectError:
            await asyncio.sleep(0.05)
