"""Bad flags and credentials from a new user's run (issue 21): each a clear message and exit code 2 (or, where it
can be, support), never a traceback; checked through the real command."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from proc_helpers import free_port
from sharegpu.cli import app


def _invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    assert "Traceback" not in result.output
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "--scheduler-name is empty"),
        ("not a valid name", "--scheduler-name 'not a valid name' is not a valid scheduler name"),
        ("Sharegpu", "must be a DNS-1123 subdomain"),
        ("-lead", "must be a DNS-1123 subdomain"),
        ("a" * 254, "at most 253 characters"),
    ],
)
@pytest.mark.parametrize("command", ["scheduler-extender", "webhook"])
def test_a_scheduler_name_that_no_pod_can_carry_is_refused(
    tmp_path: Path, command: str, name: str, message: str
) -> None:
    args = [command, "--scheduler-name", name, "--listen", f"127.0.0.1:{free_port()}"]
    if command == "webhook":  # files that are never read: the name is checked first
        args += ["--tls-cert", str(tmp_path / "c"), "--tls-key", str(tmp_path / "k")]
    else:
        args += ["--plain-http", "--kubeconfig", str(tmp_path / "none")]
    code, output = _invoke(*args)
    assert code == 2, output
    assert output.startswith("sharegpu: ") and message in output


@pytest.mark.parametrize("name", ["sharegpu-scheduler", "gpu.example.com", "s1"])
def test_valid_scheduler_names_pass_the_check(name: str) -> None:
    from sharegpu.k8s.cli import check_scheduler_name

    assert check_scheduler_name(name) == name
