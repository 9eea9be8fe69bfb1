"""Bad input found in a new user's run (issue 8, item 9): each is a clear message and exit code 2, never a traceback,
checked through the real command (CliRunner, or a real process where the behaviour is its log) and real sockets."""

from __future__ import annotations

import json
import select
import socket
from pathlib import Path

import pytest
from k8s_helpers import LoopbackServer, pod_obj
from tls_helpers import Pki, make_pki_or_skip
from typer.testing import CliRunner

from proc_helpers import Proc, free_port, kubeconfig
from sharegpu.cli import app
from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.server import Extender, make_app
from sharegpu.k8s.webhook.admission import WebhookConfig
from sharegpu.k8s.webhook.admission import make_app as webhook_app

MIB = 1024 * 1024
GOOD = "apiVersion: v1\nclusters: [{name: c, cluster: {server: 'https://127.0.0.1:6443'}}]\n"
BROKEN_KUBECONFIGS: dict[str, tuple[str | bytes, str]] = {
    "malformed-yaml": ("clusters: [{name: c\n", "is not valid YAML: line 2, column 1"),
    "empty-list": ("[]\n", "holds an empty YAML list, not a kubeconfig"),
    "empty-mapping": ("{}\n", "has no clusters"),
    "empty-file": ("", "holds nothing (it is empty), not a kubeconfig"),
    "binary": (b"\x89PNG\r\n\x1a\n\xff\xfe\x00", "is not a text file"),
    "clusters-not-a-list": ("clusters: {a: 1}\ncontexts: []\n", "clusters is a mapping, not a list"),
    "no-current-context": (GOOD + "contexts: [{name: x, context: {cluster: c}}]\n", "sets no current-context"),
    "unknown-context": (
        GOOD + "contexts: [{name: x, context: {cluster: c}}]\ncurrent-context: y\n",
        "current-context 'y' is not among its contexts (x)",
    ),
    "dangling-cluster": (
        GOOD + "contexts: [{name: x, context: {cluster: gone}}]\ncurrent-context: x\n",
        "context 'x' names cluster 'gone', which is not among its clusters (c)",
    ),
    "dangling-user": (
        GOOD + "contexts: [{name: x, context: {cluster: c, user: me}}]\ncurrent-context: x\n",
        "names user 'me', which is not among its users (none)",
    ),
    "missing-ca-file": (
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:6443', certificate-authority: /nonexistent/ca.crt}}]\n"
        "contexts: [{name: x, context: {cluster: c}}]\ncurrent-context: x\n",
        "the certificate-authority of cluster 'c', /nonexistent/ca.crt, is not a file",
    ),
}
COMMANDS = {"status": ["status"], "scheduler-extender": ["scheduler-extender", "--plain-http"]}


def _invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    assert "Traceback" not in result.output
    return result.exit_code, result.output


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", BROKEN_KUBECONFIGS)
def test_a_broken_kubeconfig_is_named_with_what_is_wrong(tmp_path: Path, command: str, case: str) -> None:
    content, message = BROKEN_KUBECONFIGS[case]
    path = tmp_path / "kubeconfig"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, output = _invoke(*COMMANDS[command], "--kubeconfig", str(path))
    assert code == 2, output
    assert f"kubeconfig {path}" in output and message in output


@pytest.mark.parametrize("command", COMMANDS)
def test_a_directory_is_not_reported_as_missing(tmp_path: Path, command: str) -> None:
    code, output = _invoke(*COMMANDS[command], "--kubeconfig", str(tmp_path))
    assert code == 2
    assert f"kubeconfig {tmp_path} is a directory, not a file" in output and "not found" not in output


def test_status_names_the_api_server_it_cannot_reach(tmp_path: Path) -> None:
    url = f"https://127.0.0.1:{free_port()}"
    code, output = _invoke("status", "--kubeconfig", str(kubeconfig(tmp_path / "kc", url)))
    assert code == 2
    assert f"the API server at {url} did not answer" in output and str(tmp_path / "kc") in output


def test_extender_logs_its_startup_and_names_the_api_server_it_cannot_reach(tmp_path: Path) -> None:
    url = f"https://127.0.0.1:{free_port()}"
    port, health = free_port(), free_port()
    kc = kubeconfig(tmp_path / "kc", url)
    with Proc(
        "scheduler-extender", "--plain-http", "--kubeconfig", str(kc),
        "--listen", f"127.0.0.1:{port}", "--health-listen", f"127.0.0.1:{health}",
    ) as proc:  # fmt: skip
        proc.wait_for(lambda line: f"the API server at {url} did not answer" in line)
        log = "\n".join(proc.lines)
        steps = [
            "serving plain HTTP without client certificates",
            "loading credentials",
            f"API server {url} (credentials: kubeconfig {kc})",
            f"scheduler extender listening on http://127.0.0.1:{port} (plain HTTP)",
            f"health probes listening on http://127.0.0.1:{health}",
        ]
        at = [log.find(s) for s in steps]
        assert all(i >= 0 for i in at) and at == sorted(at), log
        assert proc.stop() == 0  # SIGTERM stops it cleanly


def test_extender_reports_a_port_in_use(tmp_path: Path) -> None:
    kc = kubeconfig(tmp_path / "kc", f"https://127.0.0.1:{free_port()}")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, output = _invoke(
            "scheduler-extender", "--plain-http", "--kubeconfig", str(kc), "--listen", f"127.0.0.1:{port}"
        )
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in output


# ----- request bodies -------------------------------------------------------------------------------------------
def _extender(max_bytes: int | None = None) -> LoopbackServer:
    view = ClusterView()
    view.reset([], [])
    view.synced = True
    ext = Extender(view, None, policy="bestfit")
    return LoopbackServer(make_app(ext) if max_bytes is None else make_app(ext, max_bytes))


def _head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def _read_response(sock: socket.socket) -> bytes:
    """Up to the end of the connection (a 413 closes it)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_body_declared_above_the_cap_is_refused_before_it_is_sent() -> None:
    with _extender() as srv, socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
        sock.sendall(_head("/filter", {"Content-Length": str(600 * 1000 * 1000)}))  # and not one byte of it
        response = _read_response(sock)
    assert _status(response) == 413
    assert b"declares 600000000 bytes; the cap is 16 MiB" in response


def test_a_streamed_body_is_cut_off_at_the_cap_without_reading_the_rest() -> None:
    cap = 1 * MIB
    chunk = b"x" * 65536
    sent = 0
    response = b""
    with _extender(cap) as srv, socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
        sock.sendall(_head("/filter", {"Transfer-Encoding": "chunked"}))
        try:
            while sent < 256 * MIB:  # endless, as far as the server can tell
                if select.select([sock], [], [], 0.005)[0]:
                    break
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        except OSError:
            pass  # the server closed the connection after its answer
        response = _read_response(sock)
    assert _status(response) == 413
    assert b"sent more than 1048576 bytes" in response
    assert sent < 32 * MIB  # answered long before the end (loopback buffers hold a few MiB)


def test_the_largest_body_of_a_10000_node_cluster_is_accepted() -> None:
    names = [f"gpu-node-{i:05d}-" + "a" * 237 for i in range(10_000)]  # 253 characters, the longest node name
    body = {"Pod": pod_obj("p", memory="10Gi"), "NodeNames": names}
    assert len(json.dumps(body)) > 2.5 * 1000 * 1000
    with _extender() as srv:
        status, answer = srv.post("/filter", body)
    assert status == 200
    assert len(answer["FailedAndUnresolvableNodes"]) == 10_000  # read and answered, node by node


def test_the_webhook_caps_bodies_too() -> None:
    with LoopbackServer(webhook_app(WebhookConfig())) as srv, socket.create_connection(("127.0.0.1", srv.port), 5) as s:
        s.sendall(_head("/mutate", {"Content-Length": str(100 * MIB)}))
        response = _read_response(s)
    assert _status(response) == 413 and b"AdmissionReview" in response


# ----- TLS files ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki_or_skip(tmp_path_factory.mktemp("pki"))


def _junk(tmp_path: Path) -> dict[str, Path]:
    files = {
        "text": "hello, not a certificate\n",
        "bad-cert": "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        "bad-key": "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
    }
    out = {}
    for name, text in files.items():
        out[name] = tmp_path / name
        out[name].write_text(text)
    return out


@pytest.mark.parametrize(
    ("cert", "key", "message"),
    [
        ("text", "server_key", "--tls-cert {cert} is not a PEM certificate"),
        ("server_key", "server_crt", "--tls-cert {cert} holds a private key, not a certificate: are --tls-cert and "
         "--tls-key swapped?"),
        ("server_crt", "server_crt", "--tls-key {key} holds a certificate, not a private key"),
        ("server_crt", "client_key", "--tls-key {key} is not the key of the certificate in --tls-cert {cert}"),
        ("bad-cert", "server_key", "--tls-cert {cert} holds a certificate block that does not parse"),
        ("server_crt", "bad-key", "--tls-key {key} cannot be used with --tls-cert {cert}"),
        ("missing", "server_key", "--tls-cert {cert} does not exist"),
    ],
)  # fmt: skip
def test_webhook_names_the_certificate_file_and_what_is_wrong(
    tmp_path: Path, pki: Pki, cert: str, key: str, message: str
) -> None:
    files = _junk(tmp_path) | {"missing": tmp_path / "missing.pem"}
    files |= {"server_crt": pki.server_crt, "server_key": pki.server_key, "client_key": pki.client_key}
    code, output = _invoke(
        "webhook", "--listen", f"127.0.0.1:{free_port()}", "--tls-cert", str(files[cert]), "--tls-key", str(files[key])
    )
    assert code == 2
    assert message.format(cert=files[cert], key=files[key]) in " ".join(output.split())
    assert "PEM lib" not in output


def test_extender_names_a_client_ca_that_is_not_a_certificate(tmp_path: Path, pki: Pki) -> None:
    junk = _junk(tmp_path)["text"]
    code, output = _invoke(
        "scheduler-extender", "--tls-cert", str(pki.server_crt), "--tls-key", str(pki.server_key),
        "--client-ca", str(junk),
    )  # fmt: skip
    assert code == 2 and f"--client-ca {junk} is not a PEM CA certificate" in output
