"""A node agent started before the kubelet (or pointed at the wrong directory) says so and waits, as the real device
plugins do, instead of serving without a word; it registers as soon as kubelet.sock appears. A real agent process."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from node_fakes import SIM_YAML, FakeKubelet

from proc_helpers import Proc, free_port, kubeconfig


def test_agent_warns_while_kubelet_sock_is_missing_and_registers_once_it_appears(
    tmp_path: Path, sock_dir: Path
) -> None:
    plugin_dir = sock_dir / "device-plugins"  # does not exist yet: the agent makes it, and says so
    (tmp_path / "sim.yaml").write_text(SIM_YAML)
    env = os.environ | {"SHAREGPU_STATE_DIR": str(tmp_path / "state")}
    api = kubeconfig(tmp_path / "kc", f"https://127.0.0.1:{free_port()}")  # no API server: the plugin runs anyway
    args = ["node-agent", "--node-name", "node-a", "--backend", "sim", "--sim-config", str(tmp_path / "sim.yaml")]
    args += ["--kubeconfig", str(api), "--device-plugin-dir", str(plugin_dir), "--cdi-dir", str(tmp_path / "cdi")]
    args += ["--metrics-listen", f"127.0.0.1:{free_port()}"]

    async def main() -> None:
        with Proc(*args, env=env) as proc:
            warning = await asyncio.to_thread(proc.wait_for, lambda line: "kubelet.sock" in line and "WARNING" in line)
            assert (
                f"{plugin_dir / 'kubelet.sock'} does not exist (the directory did not exist; sharegpu created it)"
                in warning
            )
            assert "is --device-plugin-dir its device plugin directory (/var/lib/kubelet/device-plugins" in warning
            kubelet = FakeKubelet(plugin_dir)
            await kubelet.start()
            try:
                await asyncio.to_thread(proc.wait_for, lambda line: "appeared after" in line and "registering" in line)
                await asyncio.wait_for(kubelet.registered.wait(), 20)
                assert kubelet.requests[0].resource_name == "sharegpu.io/gpu"
            finally:
                await kubelet.stop()
            assert proc.stop() == 0

    asyncio.run(main())
