"""Issue 28, credentials: an exec plugin that never answers, a plugin's client certificate, basic auth, proxy-url,
swapped client certificate and key, a --serve port out of range."""

from __future__ import annotations

import http.server
import os
import ssl
import stat
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_k8s_kubeconfig_issue21 import EMPTY, FakeApiServer, status, write
from tls_helpers import Pki, make_pki_or_skip
from typer.testing import CliRunner

from proc_helpers import free_port
from sharegpu.cli import app
from sharegpu.kube import exec_auth

V1 = "client.authentication.k8s.io/v1"


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    s = FakeApiServer()
    yield s
    s.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki_or_skip(tmp_path_factory.mktemp("pki"))


def script(path: Path, body: str) -> Path:
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def exec_user(command: Path) -> str:
    return f"{{exec: {{apiVersion: {V1}, command: '{command}', interactiveMode: Never}}}}"


def test_a_plugin_that_never_answers_is_stopped_with_what_it_started(
    tmp_path: Path, server: FakeApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A shell script whose child keeps the pipes open: killing the script alone left `status` waiting forever.
    plugin = script(tmp_path / "hang.sh", f"#!/bin/sh\nsleep 300 &\necho $! > {tmp_path}/child\nwait\n")
    monkeypatch.setattr(exec_auth, "RUN_TIMEOUT_S", 1.0)
    kc = write(tmp_path / "kc", server.url, user=exec_user(plugin))
    done: list[tuple[int, str]] = []
    t = threading.Thread(target=lambda: done.append(status(kc)), daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "status still waits for the plugin"
    code, output = done[0]
    assert code == 2
    assert f"the exec plugin '{plugin}' of kubeconfig {kc} gave no answer in 1 s and was stopped" in output
    child = int((tmp_path / "child").read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the plugin's child still runs")


def cert_plugin(tmp_path: Path, cert: Path | None, key: Path | None) -> Path:
    status_items = []
    if cert is not None:
        status_items.append(f"'clientCertificateData': open({str(cert)!r}).read()")
    if key is not None:
        status_items.append(f"'clientKeyData': open({str(key)!r}).read()")
    return script(
        tmp_path / "certs.py",
        f"#!{sys.executable}\nimport json\n"
        f"print(json.dumps({{'apiVersion': {V1!r}, 'kind': 'ExecCredential', 'status': {{{', '.join(status_items)}}}}}))\n",
    )


@pytest.fixture
def mtls_server(pki: Pki) -> Iterator[FakeApiServer]:
    """An HTTPS server that takes only clients with a certificate signed by the test CA (as an API server does)."""
    s = FakeApiServer()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(pki.server_crt, pki.server_key)
    ctx.load_verify_locations(pki.ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    s.httpd.socket = ctx.wrap_socket(s.httpd.socket, server_side=True)
    s.url = s.url.replace("http://", "https://")
    yield s
    s.close()


def test_a_plugin_may_answer_with_a_client_certificate(tmp_path: Path, pki: Pki, mtls_server: FakeApiServer) -> None:
    ca = f", certificate-authority: '{pki.ca}'"
    kc = write(tmp_path / "kc", mtls_server.url, ca, exec_user(cert_plugin(tmp_path, pki.client_crt, pki.client_key)))
    code, output = status(kc)
    assert code == 0, output
    assert "0/0 GPUs in use" in output
    assert mtls_server.auth and set(mtls_server.auth) == {""}  # no bearer token: the certificate authenticates


@pytest.mark.parametrize(
    ("which", "message"),
    [
        ("cert-only", "gave clientCertificateData without clientKeyData; a client certificate needs both"),
        ("swapped", "its clientCertificateData holds no PEM certificate and clientKeyData holds no PEM private key"),
        ("mismatched", "do not load together"),
    ],
)
def test_a_plugin_certificate_that_cannot_be_used_is_named(
    tmp_path: Path, pki: Pki, mtls_server: FakeApiServer, which: str, message: str
) -> None:
    cert, key = {
        "cert-only": (pki.client_crt, None),
        "swapped": (pki.client_key, pki.client_crt),
        "mismatched": (pki.client_crt, pki.rogue_key),
    }[which]
    plugin = cert_plugin(tmp_path, cert, key)
    kc = write(tmp_path / "kc", mtls_server.url, f", certificate-authority: '{pki.ca}'", exec_user(plugin))
    code, output = status(kc)
    assert code == 2
    assert f"the exec plugin '{plugin}'" in output and message in output


def test_swapped_client_certificate_and_key_files_are_named(tmp_path: Path, pki: Pki) -> None:
    user = f"{{client-certificate: '{pki.client_key}', client-key: '{pki.client_crt}'}}"
    kc = write(tmp_path / "kc", "https://127.0.0.1:1", f", certificate-authority: '{pki.ca}'", user)
    code, output = status(kc)
    assert code == 2
    assert (
        f"the client-certificate {pki.client_key} holds a private key and the client-key {pki.client_crt} a " in output
    )
    assert "swapped" in output and "PEM lib" not in output


def test_a_key_of_another_certificate_is_named(tmp_path: Path, pki: Pki) -> None:
    user = f"{{client-certificate: '{pki.client_crt}', client-key: '{pki.rogue_key}'}}"
    kc = write(tmp_path / "kc", "https://127.0.0.1:1", f", certificate-authority: '{pki.ca}'", user)
    code, output = status(kc)
    assert code == 2
    assert (
        f"the client-certificate {pki.client_crt} and the client-key {pki.rogue_key} do not belong together" in output
    )


@pytest.mark.parametrize(
    ("user", "header"),
    [
        ("{username: alice, password: s3cret}", "Basic YWxpY2U6czNjcmV0"),
        ("{username: alice}", "Basic YWxpY2U6"),  # client-go sends a username alone with an empty password
    ],
)
def test_basic_auth_is_sent(tmp_path: Path, server: FakeApiServer, user: str, header: str) -> None:
    code, output = status(write(tmp_path / "kc", server.url, user=user))
    assert code == 0, output
    assert server.auth and set(server.auth) == {header}


class Proxy:
    """A forward HTTP proxy's first half: it answers the absolute-URL requests a client sends a proxy itself, with
    the empty lists the fake API server gives, and records the URLs. ``forbid``: paths answered 403."""

    def __init__(self, forbid: str = "") -> None:
        self.urls: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.urls.append(self.path)
                if forbid and forbid in self.path:
                    code = 403
                    body = b'{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Forbidden",'
                    body += b'"message":"resourceslices is forbidden","code":403}'
                elif "/nodes" in self.path or "/pods" in self.path:
                    body, code = EMPTY["NodeList" if "/nodes" in self.path else "PodList"], 200
                else:
                    body, code = b'{"kind":"Status","apiVersion":"v1","status":"Failure","code":404}', 404
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def test_requests_go_through_the_clusters_proxy_url(tmp_path: Path) -> None:
    proxy = Proxy()
    try:
        api = f"http://127.0.0.1:{free_port()}"  # nothing listens there: only the proxy can answer
        code, output = status(write(tmp_path / "kc", api, f", proxy-url: '{proxy.url}'"))
    finally:
        proxy.httpd.shutdown()
        proxy.httpd.server_close()
    assert code == 0, output
    assert any(u.startswith(f"{api}/api/v1/nodes") for u in proxy.urls), proxy.urls


def test_a_socks_proxy_is_refused_by_name(tmp_path: Path) -> None:
    kc = write(tmp_path / "kc", "https://127.0.0.1:1", ", proxy-url: 'socks5://127.0.0.1:1080'")
    code, output = status(kc)
    assert code == 2
    assert f"kubeconfig {kc}: cluster 'c' has proxy-url 'socks5://127.0.0.1:1080'" in output
    assert "http:// and https:// proxies only" in output


def test_a_serve_port_out_of_range_is_named_as_such(tmp_path: Path, server: FakeApiServer) -> None:
    kc = write(tmp_path / "kc", server.url)
    result = CliRunner().invoke(app, ["status", "--kubeconfig", str(kc), "--serve", "127.0.0.1:99999"])
    output = " ".join(result.output.split())
    assert result.exit_code == 2
    assert "--serve '127.0.0.1:99999': port 99999 is out of range; a TCP port is 1 to 65535" in output
    assert "0.0.0.0" not in output


def test_status_without_rights_on_resourceslices_shows_the_rest_and_warns_once(tmp_path: Path) -> None:
    api = Proxy(forbid="/apis/resource.k8s.io/")
    try:
        result = CliRunner().invoke(app, ["status", "--kubeconfig", str(write(tmp_path / "kc", api.url))])
    finally:
        api.httpd.shutdown()
        api.httpd.server_close()
    output = " ".join(result.output.split())
    assert result.exit_code == 0, output
    assert "0/0 GPUs in use on 0 node(s)" in output
    assert output.count("warning: not showing DRA GPUs:") == 1
    assert "grant list on resourceslices and resourceclaims (resource.k8s.io)" in output


@pytest.mark.parametrize("command", ["status", "scheduler-extender", "node-agent", "dra-driver"])
def test_kubeconfig_help_says_the_real_order(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"], terminal_width=300)
    text = " ".join(result.output.replace("│", " ").split())
    assert "in-cluster config if omitted" not in text
    assert (
        "Default: the in-cluster service account when running in a pod, else the first file of $KUBECONFIG, else "
        "~/.kube/config." in text
    )


@pytest.mark.parametrize(
    "command", [["sim"], ["trace", "vary"], ["trace", "describe"], ["status"], ["node-agent"], ["dra-driver"]]
)
def test_help_is_never_cut_on_an_80_column_terminal(command: list[str]) -> None:
    # A path longer than the help column was cut to "…" (/var/lib/kubelet/device-plugin…).
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in result.output, [line for line in lines if "…" in line]
