"""Issue 28: the node daemons refuse a bad flag at start, exit 2 with a message (no traceback, no endless retry)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from node_fakes import SIM_YAML
from typer.testing import CliRunner, Result

from sharegpu.cli import app


def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str]:
    (tmp_path / "sim.yaml").write_text(SIM_YAML)
    monkeypatch.setenv("SHAREGPU_STATE_DIR", str(tmp_path / "state"))
    # An API server that cannot be reached: a flag that is accepted would leave the daemon retrying, not exit 2.
    kc = tmp_path / "kc"
    kc.write_text(
        "apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "contexts: [{name: x, context: {cluster: c}}]\ncurrent-context: x\n"
    )
    argv = [*args, "--backend", "sim", "--sim-config", str(tmp_path / "sim.yaml"), "--kubeconfig", str(kc)]
    results: list[Result] = []
    # In a thread: a daemon that took the flag would run (and retry) for ever; the test then fails instead of hanging.
    t = threading.Thread(target=lambda: results.append(CliRunner().invoke(app, argv)), daemon=True)
    t.start()
    t.join(60)
    assert results, f"{args[0]} took the flags and runs: {argv}"
    result = results[0]
    assert "Traceback" not in result.output
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.parametrize("name", ["Bad_Name!", "UPPER", "-dash", "a" * 254, "node..a"])
@pytest.mark.parametrize("command", ["node-agent", "dra-driver"])
def test_a_node_name_kubernetes_would_refuse_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, name: str
) -> None:
    extra = ["--cdi-dir", str(tmp_path / "cdi")]
    extra += ["--kubelet-dir", str(tmp_path / "k")] if command == "dra-driver" else ["--metrics-listen", ""]
    code, out = run(tmp_path, monkeypatch, command, "--node-name", name, *extra)
    assert code == 2
    assert "--node-name: node name" in out and "DNS-1123 subdomain" in out and "--node-name $(NODE_NAME)" in out


@pytest.mark.parametrize(
    ("cdi", "message"),
    [
        ("/proc/cdi", "--cdi-dir /proc/cdi: cannot write CDI specs in /proc/cdi"),
        ("{file}", "exists and is not a directory"),
        ("{file}/cdi", "cannot write CDI specs in"),
    ],
)
def test_node_agent_refuses_a_cdi_dir_it_cannot_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cdi: str, message: str
) -> None:
    (tmp_path / "afile").write_text("x")
    cdi = cdi.format(file=tmp_path / "afile")
    code, out = run(
        tmp_path,
        monkeypatch,
        "node-agent",
        "--node-name",
        "node-a",
        "--cdi-dir",
        cdi,
        "--device-plugin-dir",
        str(tmp_path / "dp"),
        "--metrics-listen",
        "",
    )
    assert code == 2 and message in out


def test_dra_driver_refuses_a_registration_socket_that_is_a_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reg = tmp_path / "registry"
    reg.mkdir()
    code, out = run(
        tmp_path,
        monkeypatch,
        "dra-driver",
        "--node-name",
        "node-a",
        "--kubelet-dir",
        str(tmp_path / "k"),
        "--cdi-dir",
        str(tmp_path / "cdi"),
        "--registration-socket",
        str(reg),
    )
    assert code == 2
    assert (
        f"--registration-socket {reg} is a directory; name the socket file inside it, e.g. {reg}/gpu.sharegpu.io-reg.sock"
        in out
    )
    assert "Event loop is closed" not in out
