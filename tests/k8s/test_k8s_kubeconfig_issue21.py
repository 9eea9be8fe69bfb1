"""Kubeconfigs from a new user's run (issue 21), through ``sharegpu status`` against a stand-in API server on real
loopback HTTP: plain http:// (kubectl proxy) works, http:// written for an HTTPS port is named, bad inline PEM data is
named by field, and exec plugins of client.authentication.k8s.io/v1 (today's cloud CLIs) run as client-go runs them."""

from __future__ import annotations

import base64
import http.server
import json
import ssl
import stat
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from tls_helpers import Pki, make_pki_or_skip
from typer.testing import CliRunner

from proc_helpers import Proc, free_port
from sharegpu.cli import app

EMPTY = {"NodeList": b'{"kind":"NodeList","apiVersion":"v1","metadata":{"resourceVersion":"5"},"items":[]}'}
EMPTY["PodList"] = EMPTY["NodeList"].replace(b"NodeList", b"PodList")


class FakeApiServer:
    """Answers node and pod lists with empty lists and everything else 404 (no resource.k8s.io: no DRA); records the
    Authorization header of each request; ``mode`` "go-https" answers as Go's HTTPS server answers a plain request."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.tokens: set[str] = set()  # the bearer tokens accepted (none given: every request is)
        self.auth: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.auth.append(self.headers.get("Authorization", ""))
                if outer.mode == "go-https":  # net/http's answer, no Content-Type
                    body = b"Client sent an HTTP request to an HTTPS server.\n"
                    self.send_response(400)
                elif outer.tokens and self.headers.get("Authorization") not in {f"Bearer {t}" for t in outer.tokens}:
                    body = b'{"kind":"Status","apiVersion":"v1","status":"Failure","message":"Unauthorized","code":401}'
                    self.send_response(401)
                    self.send_header("Content-Type", "application/json")
                elif "/nodes" in self.path or "/pods" in self.path:
                    body = EMPTY["NodeList" if "/nodes" in self.path else "PodList"]
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                else:
                    body = b'{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404}'
                    self.send_response(404)
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    s = FakeApiServer()
    yield s
    s.close()


def write(path: Path, server: str, cluster_extra: str = "", user: str = "{}") -> Path:
    path.write_text(
        f"apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {{server: '{server}'{cluster_extra}}}\n"
        "contexts:\n- name: x\n  context: {cluster: c, user: u}\n"
        f"users:\n- name: u\n  user: {user}\n"
        "current-context: x\n"
    )
    return path


def status(kc: Path) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["status", "--kubeconfig", str(kc)])
    assert "Traceback" not in result.output
    return result.exit_code, " ".join(result.output.split())


def test_a_plain_http_server_is_supported(tmp_path: Path, server: FakeApiServer) -> None:
    code, output = status(write(tmp_path / "kc", server.url))
    assert code == 0, output
    assert "0/0 GPUs in use on 0 node(s)" in output


def test_http_written_for_an_https_port_says_to_write_https(tmp_path: Path) -> None:
    s = FakeApiServer("go-https")
    try:
        code, output = status(write(tmp_path / "kc", s.url))
    finally:
        s.close()
    port = s.url.rsplit(":", 1)[1]
    assert code == 2
    assert f"the API server at http://127.0.0.1:{port} serves HTTPS only; write https://127.0.0.1:{port}" in output
    assert "KeyError" not in output


PEM = b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("certificate-authority-data", "notbase64!!", "the certificate-authority-data of cluster 'c' is not base64"),
        (
            "certificate-authority-data",
            base64.b64encode(b"hello\n").decode(),
            "of cluster 'c' holds no PEM certificate",
        ),
        ("certificate-authority-data", base64.b64encode(PEM).decode(), "of cluster 'c' holds a certificate that does"),
        ("client-key-data", base64.b64encode(b"hello\n").decode(), "the client-key-data of user 'u' holds no PEM"),
    ],
)
def test_bad_inline_pem_data_is_named_by_field_and_file(tmp_path: Path, field: str, value: str, message: str) -> None:
    if field.startswith("certificate"):
        kc = write(tmp_path / "kc", "https://127.0.0.1:1", cluster_extra=f", {field}: '{value}'")
    else:
        kc = write(tmp_path / "kc", "https://127.0.0.1:1", user=f"{{{field}: '{value}'}}")
    code, output = status(kc)
    assert code == 2 and f"kubeconfig {kc}: the {field} " in output and message in output
    assert "it must be the base64 of a PEM file" in output


def plugin(tmp_path: Path, version: str, expiry: str = "") -> Path:
    """An exec plugin that answers as client-go's do (in the version KUBERNETES_EXEC_INFO asks for), counting its runs
    and recording the KUBERNETES_EXEC_INFO it got."""
    script = tmp_path / "plugin.py"
    status_extra = f', "expirationTimestamp": "{expiry}"' if expiry else ""
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, pathlib\n"
        f"d = pathlib.Path({str(tmp_path)!r})\n"
        "runs = len(list(d.glob('run-*'))) + 1\n"
        "(d / f'run-{runs}').write_text(os.environ.get('KUBERNETES_EXEC_INFO', ''))\n"
        "info = json.loads(os.environ['KUBERNETES_EXEC_INFO'])\n"
        "print(json.dumps({'apiVersion': info['apiVersion'], 'kind': 'ExecCredential', "
        f"'status': {{'token': f'tok-{{runs}}'{status_extra}}}}}))\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def exec_user(script: Path, version: str, mode: str | None = "IfAvailable") -> str:
    extra = f", interactiveMode: {mode}" if mode else ""
    return f"{{exec: {{apiVersion: {version}, command: '{script}', args: [get-token]{extra}}}}}"


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
def test_an_exec_plugin_of_v1_and_v1beta1_authenticates(tmp_path: Path, server: FakeApiServer, version: str) -> None:
    full = f"client.authentication.k8s.io/{version}"
    server.tokens = {"tok-1"}  # status reads everything (nodes, pods, the DRA objects) through one client
    kc = write(tmp_path / "kc", server.url, user=exec_user(plugin(tmp_path, full), full))
    code, output = status(kc)
    assert code == 0, output
    assert len(server.auth) >= 3 and set(server.auth) == {"Bearer tok-1"}
    assert len(list(tmp_path.glob("run-*"))) == 1  # a token is reused while valid
    info = json.loads((tmp_path / "run-1").read_text())
    assert info == {"apiVersion": full, "kind": "ExecCredential", "spec": {"interactive": False}}


def test_an_expired_token_runs_the_plugin_again(tmp_path: Path, server: FakeApiServer) -> None:
    full = "client.authentication.k8s.io/v1"
    kc = write(tmp_path / "kc", server.url, user=exec_user(plugin(tmp_path, full, "2001-01-01T00:00:00Z"), full))
    code, output = status(kc)
    assert code == 0, output
    runs = len(list(tmp_path.glob("run-*")))
    assert runs == len(server.auth) >= 2  # one run per request: each token had expired when it came
    assert server.auth[:2] == ["Bearer tok-1", "Bearer tok-2"]


def test_a_401_runs_the_plugin_again(tmp_path: Path, server: FakeApiServer) -> None:
    full = "client.authentication.k8s.io/v1"
    server.tokens = {"tok-2", "tok-3"}  # the first token is refused, later ones taken
    kc = write(tmp_path / "kc", server.url, user=exec_user(plugin(tmp_path, full), full))
    code, output = status(kc)
    assert code == 0, output
    assert server.auth[:2] == ["Bearer tok-1", "Bearer tok-2"] and "Bearer tok-1" not in server.auth[2:]


@pytest.mark.parametrize(
    ("user", "message"),
    [
        (
            "{exec: {apiVersion: client.authentication.k8s.io/v1, command: x}}",
            "user 'u': exec of client.authentication.k8s.io/v1 needs interactiveMode (Never or IfAvailable)",
        ),
        (
            "{exec: {apiVersion: client.authentication.k8s.io/v1, command: x, interactiveMode: Always}}",
            "exec interactiveMode is Always, but sharegpu runs the plugin without a terminal",
        ),
        ("{exec: {apiVersion: client.authentication.k8s.io/v2, command: x}}", "exec apiVersion 'client.authentic"),
    ],
)
def test_an_exec_section_that_cannot_run_is_named(tmp_path: Path, user: str, message: str) -> None:
    kc = write(tmp_path / "kc", "https://127.0.0.1:1", user=user)
    code, output = status(kc)
    assert code == 2 and f"kubeconfig {kc}: " in output and message in output


def test_a_missing_plugin_gives_its_install_hint(tmp_path: Path, server: FakeApiServer) -> None:
    user = (
        "{exec: {apiVersion: client.authentication.k8s.io/v1, command: gke-gcloud-auth-plugin-absent, "
        "interactiveMode: IfAvailable, installHint: 'install it with gcloud components install'}}"
    )
    code, output = status(write(tmp_path / "kc", server.url, user=user))
    assert code == 2
    assert "cannot run the exec plugin 'gke-gcloud-auth-plugin-absent' of kubeconfig" in output
    assert "install it with gcloud components install" in output


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki_or_skip(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def tls_server(pki: Pki) -> Iterator[FakeApiServer]:
    s = FakeApiServer()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(pki.server_crt, pki.server_key)
    s.httpd.socket = ctx.wrap_socket(s.httpd.socket, server_side=True)
    s.url = s.url.replace("http://", "https://")
    yield s
    s.close()


def test_a_wrong_ca_is_named_with_what_to_change(tmp_path: Path, pki: Pki, tls_server: FakeApiServer) -> None:
    kc = write(tmp_path / "kc", tls_server.url, cluster_extra=f", certificate-authority: '{pki.rogue_ca}'")
    code, output = status(kc)
    assert code == 2
    assert f"certificate-authority {pki.rogue_ca} of cluster 'c' (kubeconfig {kc})" in output
    assert "set the cluster's certificate-authority (or certificate-authority-data) to the CA that signed" in output
    assert "did not answer" not in output
    good = write(tmp_path / "good", tls_server.url, cluster_extra=f", certificate-authority: '{pki.ca}'")
    assert status(good)[0] == 0


def test_the_extender_says_which_ca_is_wrong_each_time_it_retries(
    tmp_path: Path, pki: Pki, tls_server: FakeApiServer
) -> None:
    kc = write(tmp_path / "kc", tls_server.url, cluster_extra=f", certificate-authority: '{pki.rogue_ca}'")
    with Proc(
        "scheduler-extender", "--plain-http", "--kubeconfig", str(kc), "--listen", f"127.0.0.1:{free_port()}"
    ) as p:
        line = p.wait_for(lambda line: "retrying in" in line)
        assert f"is not signed by the certificate-authority {pki.rogue_ca} of cluster 'c'" in line
        assert "CERTIFICATE_VERIFY_FAILED" not in line
        assert p.stop() == 0
