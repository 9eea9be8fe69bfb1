"""Only the scheduler may call the extender (issue 8, item 10): a real ``sharegpu scheduler-extender`` process serves
HTTPS and requires a client certificate from its --client-ca; clients without one, or with one from another CA, get
no answer. The kubelet's probes are served alone on a plain-HTTP port."""

from __future__ import annotations

import http.client
import json
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from k8s_helpers import pod_obj
from tls_helpers import Pki, make_pki_or_skip
from typer.testing import CliRunner

from proc_helpers import Proc, free_port, kubeconfig
from sharegpu.cli import app
from sharegpu.k8s.serving.body_limit import EXTENDER_MAX_BODY

FILTER = {"Pod": pod_obj("p", memory="10Gi"), "NodeNames": ["node-a"]}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki_or_skip(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def extender(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    """(TLS port, probe port) of a running extender; its API server is unreachable (it answers 'not in sync')."""
    kc = kubeconfig(tmp_path_factory.mktemp("kc") / "kc", f"https://127.0.0.1:{free_port()}")
    port, health = free_port(), free_port()
    with Proc(
        "scheduler-extender", "--kubeconfig", str(kc), "--listen", f"127.0.0.1:{port}",
        "--health-listen", f"127.0.0.1:{health}",
        "--tls-cert", str(pki.server_crt), "--tls-key", str(pki.server_key), "--client-ca", str(pki.ca),
    ) as proc:  # fmt: skip
        line = proc.wait_for(lambda line: "scheduler extender listening on" in line)
        assert f"https://127.0.0.1:{port}" in line and f"only clients with a certificate from {pki.ca}" in line
        proc.wait_for(lambda line: "health probes listening on" in line)
        yield port, health
        keep = _https(port, pki, (pki.client_crt, pki.client_key))  # the scheduler keeps its connection open
        keep.request("GET", "/healthz")
        assert keep.getresponse().read() == b"ok\n"
        started = time.monotonic()
        assert proc.stop() == 0
        assert time.monotonic() - started < 10  # an idle TLS connection does not hold the stop for 30 s
        keep.close()


def _https(port: int, pki: Pki, cert: tuple[Path, Path] | None) -> http.client.HTTPSConnection:
    ctx = ssl.create_default_context(cafile=str(pki.ca))  # the client checks the server as the scheduler does
    if cert is not None:
        ctx.load_cert_chain(*map(str, cert))
    return http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)


def _post(conn: http.client.HTTPConnection, path: str, body: object) -> tuple[int, bytes]:
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_the_schedulers_certificate_is_served(extender: tuple[int, int], pki: Pki) -> None:
    status, body = _post(_https(extender[0], pki, (pki.client_crt, pki.client_key)), "/filter", FILTER)
    assert status == 200
    answer = json.loads(body)
    assert answer["NodeNames"] == [] and "reconnecting" in answer["FailedNodes"]["node-a"]  # served: not in sync


@pytest.mark.parametrize("client", ["no certificate", "certificate of another CA"])
def test_other_clients_are_refused(extender: tuple[int, int], pki: Pki, client: str) -> None:
    cert = None if client == "no certificate" else (pki.rogue_crt, pki.rogue_key)
    # TLS 1.3: the client may finish its side of the handshake; the server's alert arrives on the first read.
    with pytest.raises((ssl.SSLError, ConnectionError)):
        _post(_https(extender[0], pki, cert), "/bind", {"PodName": "p", "PodNamespace": "default", "Node": "n"})


def test_plain_http_on_the_tls_port_gets_no_answer(extender: tuple[int, int]) -> None:
    with pytest.raises((ConnectionError, http.client.BadStatusLine)):
        _post(http.client.HTTPConnection("127.0.0.1", extender[0], timeout=10), "/filter", FILTER)


def test_the_probe_port_serves_the_probes_and_nothing_else(extender: tuple[int, int]) -> None:
    def get(path: str) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", extender[1], timeout=10)
        try:
            conn.request("GET", path)
            return conn.getresponse().status
        finally:
            conn.close()

    assert get("/healthz") == 200
    assert get("/readyz") == 503  # not in sync with the (unreachable) API server
    for verb in ("filter", "prioritize", "bind", "preempt"):
        assert _post(http.client.HTTPConnection("127.0.0.1", extender[1], timeout=10), f"/{verb}", FILTER)[0] == 404


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([], "missing --tls-cert, --tls-key, --client-ca"),
        (["--tls-cert", "c.pem", "--tls-key", "k.pem"], "missing --client-ca"),
        (["--plain-http", "--tls-cert", "c.pem"], "--plain-http serves without TLS; drop --tls-cert"),
    ],
)
def test_plain_http_only_when_asked(flags: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["scheduler-extender", *flags])
    assert result.exit_code == 2 and message in result.output


def _h2(port: int, pki: Pki, method: str, path: str, extra: list[tuple[str, str]] | None = None) -> tuple[str, bytes]:
    """One request over HTTP/2 (ALPN must choose h2) with the scheduler's certificate: (status, body). A request
    with ``extra`` headers sends those and no body (its stream left open, as a client still uploading)."""
    import socket

    import h2.config
    import h2.connection
    import h2.events

    ctx = ssl.create_default_context(cafile=str(pki.ca))
    ctx.load_cert_chain(str(pki.client_crt), str(pki.client_key))
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        assert tls.selected_alpn_protocol() == "h2"
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        headers = [(":method", method), (":path", path), (":scheme", "https"), (":authority", "127.0.0.1")]
        conn.send_headers(1, headers + (extra or []), end_stream=extra is None)
        tls.sendall(conn.data_to_send())
        status, body, ended = "", b"", False
        while not ended:
            data = tls.recv(65536)
            assert data, "the extender closed the HTTP/2 connection without answering"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    status = dict(event.headers)[b":status"].decode()
                elif isinstance(event, h2.events.DataReceived):
                    body += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                    ended = True
            tls.sendall(conn.data_to_send())
    return status, body


def test_http2_is_offered_to_the_scheduler(extender: tuple[int, int], pki: Pki) -> None:
    """ALPN offers h2 and a request over HTTP/2 is answered: the kube-scheduler's Go client then sends every call on
    one connection, where over HTTP/1.1 it kept two idle ones and opened (and closed) a TLS connection per extra
    concurrent bind."""
    assert _h2(extender[0], pki, "GET", "/healthz") == ("200", b"ok\n")


def test_an_oversized_body_is_refused_over_http2_too(extender: tuple[int, int], pki: Pki) -> None:
    """The body cap holds over HTTP/2 as over HTTP/1.1: a declared length over the cap gets the 413 with its reason
    (the answer's HTTP/1.1 ``connection: close`` is dropped by the h2 stack, which strips connection headers)."""
    declared = [("content-type", "application/json"), ("content-length", str(EXTENDER_MAX_BODY + 1))]
    status, body = _h2(extender[0], pki, "POST", "/filter", declared)
    assert status == "413" and b"request body too large" in body
