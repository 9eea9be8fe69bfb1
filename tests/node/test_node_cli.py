from __future__ import annotations

from pathlib import Path

import pytest
import typer
from node_fakes import SIM_YAML, FakeKube
from typer.testing import CliRunner

from sharegpu.node.agent import NodeAgent
from sharegpu.node.cli import BackendKind, build_agent, node_agent


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("node-agent")(node_agent)

    @app.command("noop")
    def _noop() -> None:  # a second command, so typer keeps "node-agent" as a subcommand as in the real CLI
        pass

    return app


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "sim"], "--sim-config"),
        (["--backend", "sim", "--sim-config", "{missing}"], "cannot read"),
        (["--backend", "sim", "--sim-config", "{bad}"], "unknown GPU model 'Z1'"),
        (["--backend", "sim", "--sim-config", "{good}", "--metrics-listen", "nope"], "HOST:PORT"),
        (["--backend", "sim", "--sim-config", "{good}", "--device-plugin-dir", "/" + "x" * 120], "shorter"),
        (["--backend", "sim", "--sim-config", "{good}", "--kubeconfig", "{missing}"], "Kubernetes credentials"),
        (["--backend", "sim", "--sim-config", "{garbage}"], "is not a text file (byte 0 is not UTF-8)"),
        (
            ["--backend", "sim", "--sim-config", "{good}", "--kubeconfig", "{list}"],
            "holds a YAML list, not a kubeconfig",
        ),
    ],
)
def test_bad_input_exits_with_a_message_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    (tmp_path / "bad.yaml").write_text("gpus: [{model: Z1}]")
    (tmp_path / "good.yaml").write_text(SIM_YAML)
    (tmp_path / "garbage.bin").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x01")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    monkeypatch.setenv("SHAREGPU_STATE_DIR", str(tmp_path / "state"))
    files = {"missing": tmp_path / "missing.yaml", "bad": tmp_path / "bad.yaml", "good": tmp_path / "good.yaml"}
    files |= {"garbage": tmp_path / "garbage.bin", "list": tmp_path / "list.yaml"}
    argv = [
        "node-agent",
        "--node-name",
        "node-a",
        "--cdi-dir",
        str(tmp_path / "cdi"),
        *(a.format(**files) for a in args),
    ]
    result = CliRunner().invoke(_app(), argv)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_flags_are_exactly_the_issues(tmp_path: Path) -> None:
    result = CliRunner().invoke(_app(), ["node-agent", "--help"], terminal_width=200)
    for flag in ("--node-name", "--kubeconfig", "--backend", "--sim-config", "--device-plugin-dir", "--metrics-listen"):
        assert flag in result.output
    assert "nvml" in result.output and "sim" in result.output


def test_build_agent_wires_a_sim_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sim.yaml").write_text(SIM_YAML)
    monkeypatch.setenv("SHAREGPU_STATE_DIR", str(tmp_path / "state"))
    agent = build_agent(
        "node-a",
        None,
        BackendKind.SIM,
        tmp_path / "sim.yaml",
        tmp_path / "dp",
        "127.0.0.1:0",
        FakeKube(),
        cdi_dir=tmp_path / "cdi",  # the agent checks it can write there: never the host's
    )
    assert isinstance(agent, NodeAgent)
    assert [d.model for d in agent.backend.devices()] == ["H100-80GB", "H100-80GB", "A30-24GB"]
    assert agent.config.state_dir == tmp_path / "state" and agent.config.metrics_listen == ("127.0.0.1", 0)
    assert agent.config.evict_on_audit is False  # eviction on an audit finding is opt-in
    assert agent.watch.evict is False


def test_evict_on_audit_flag_reaches_the_watch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sim.yaml").write_text(SIM_YAML)
    monkeypatch.setenv("SHAREGPU_STATE_DIR", str(tmp_path / "state"))
    agent = build_agent(
        "node-a", None, BackendKind.SIM, tmp_path / "sim.yaml", tmp_path / "dp", "", FakeKube(), evict_on_audit=True
    )
    assert agent.config.evict_on_audit is True and agent.watch.evict is True
    result = CliRunner().invoke(_app(), ["node-agent", "--help"], terminal_width=200)
    assert "--evict-on-audit" in result.output


def test_mps_multi_user_is_off_by_default_and_reaches_the_mps_manager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "sim.yaml").write_text(SIM_YAML)  # H100s and an A30: Hopper and Ampere
    monkeypatch.setenv("SHAREGPU_STATE_DIR", str(tmp_path / "state"))
    off = build_agent("node-a", None, BackendKind.SIM, tmp_path / "sim.yaml", tmp_path / "dp", "", FakeKube())
    assert off.config.mps_multi_user is False and off.mps.multi_user is False
    on = build_agent(
        "node-a", None, BackendKind.SIM, tmp_path / "sim.yaml", tmp_path / "dp", "", FakeKube(), mps_multi_user=True
    )
    assert on.config.mps_multi_user is True and on.mps.multi_user is True
    result = CliRunner().invoke(_app(), ["node-agent", "--help"], terminal_width=200)
    assert "--mps-multi-user" in result.output and "isolation between users" in result.output


@pytest.mark.parametrize("model", ["P100", "GTX-9000-unknown"])
def test_mps_multi_user_is_refused_on_a_gpu_older_than_volta(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    """On Pascal -M is accepted, but clients that are not root fail in cuInit; a GPU the catalog does not know is
    not known to be Volta."""
    (tmp_path / "sim.yaml").write_text(f"gpus: [{{model: H100-80GB}}, {{model: {model}}}]\n")
    if model != "P100":
        # The simulated backend takes catalog models only: play an unknown card through the NVML backend's resolution.
        from sharegpu.node.backends.base import DeviceInfo
        from sharegpu.node.cli import AgentSetupError, check_multi_user

        class Unknown:
            def devices(self) -> tuple[DeviceInfo, ...]:
                return (DeviceInfo(0, "GPU-x", "NVIDIA GTX 9000", model, 8192, 40, False),)

        with pytest.raises(AgentSetupError, match=r"GPU 0 \(NVIDIA GTX 9000, compute capability 0.0.0\)"):
            check_multi_user(Unknown())  # type: ignore[arg-type]
        return
    monkeypatch.setenv("SHAREGPU_STATE_DIR", str(tmp_path / "state"))
    argv = ["node-agent", "--node-name", "node-a", "--cdi-dir", str(tmp_path / "cdi"), "--backend", "sim"]
    argv += ["--sim-config", str(tmp_path / "sim.yaml"), "--mps-multi-user", "--kubeconfig", str(tmp_path / "none")]
    result = CliRunner().invoke(_app(), argv)
    assert result.exit_code == 2, result.output
    assert "--mps-multi-user needs Volta or later" in result.output
    assert "GPU 1 (Simulated P100, compute capability 6.0.0)" in result.output and "GPU 0" not in result.output
    assert "Traceback" not in result.output
