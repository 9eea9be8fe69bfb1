"""Which Xid errors are told to the pods of their unit (issue 33): faults that end processes, not the driver's cleanup.

Xid 45 is what the driver logs when it tears down the channels of a process that ended (a pod deleted, a client
killed); it followed every deleted GPU pod and became a "GPU fault" Event on the tenants of the GPU.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from node_fakes import pod
from test_node_audit import FakeNotifier

from sharegpu.model.tenant import user_tenant
from sharegpu.node.backends.base import XidEvent
from sharegpu.node.enforcement import FAULT_REASON, EnforcementWatch
from sharegpu.node.mps import DaemonKey
from sharegpu.node.xid import XIDS, XidKind, classify

U1000 = user_tenant("default", 1000)
GPU0 = DaemonKey("GPU-0", U1000)


def _told(*xids: int) -> tuple[list[str], FakeNotifier, EnforcementWatch]:
    """Each Xid alone on a GPU with one MPS daemon (where any fault is that daemon's), in windows of its own: the
    Events' messages."""

    async def main() -> tuple[list[str], FakeNotifier, EnforcementWatch]:
        clock = [0.0]
        notifier = FakeNotifier()
        watch = EnforcementWatch(notifier, fault_window_s=60, clock=lambda: clock[0])
        p = pod("p", None, uid="u")
        for x in xids:
            clock[0] += 1000
            await watch.faults([], [XidEvent(0, "GPU-0", x)], {GPU0: 0}, {GPU0: [p]})
        return [e.message for e in notifier.events if e.reason == FAULT_REASON], notifier, watch

    return asyncio.run(main())


def test_xid_45_the_drivers_cleanup_after_a_deleted_pod_is_no_fault(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "sharegpu.node.enforcement")
    messages, _, watch = _told(45)
    assert messages == []  # on today's main: one GpuMpsFault Event per pod of the daemon
    assert watch.counts().faults == () and watch.counts().xids == ((0, "GPU-0", 45, 1),)  # still counted
    assert "Xid 45 (preemptive cleanup" in caplog.text and "not told to pods" in caplog.text


def test_application_and_hardware_faults_are_told_with_what_they_mean() -> None:
    messages, _, watch = _told(31, 13, 43, 48, 79, 94, 95)
    assert len(messages) == 7
    assert "Xid 31 (GPU memory page fault: an illegal address; application)" in messages[0]
    assert "Xid 95 (uncontained ECC error" in messages[-1] and "hardware)" in messages[-1]
    assert [n for _, _, _, n in watch.counts().xids] == [1] * 7


def test_what_ends_no_process_and_what_the_table_does_not_know_are_counted_only() -> None:
    messages, _, watch = _told(63, 92, 154, 45, 999)
    assert messages == [] and watch.counts().faults == ()
    assert sorted(x for _, _, x, _ in watch.counts().xids) == [45, 63, 92, 154, 999]


def test_the_table_classifies_as_nvidias_catalogue_does() -> None:
    """NVIDIA's application errors (the device plugin's list, the GPU stays healthy: 13, 31, 43, 68) and its hardware
    and ECC Xids; 45 the cleanup; an unknown number is unknown, told to nobody."""
    assert {x for x, i in XIDS.items() if i.kind is XidKind.APPLICATION} >= {13, 31, 43, 68}
    assert {x for x, i in XIDS.items() if i.kind is XidKind.HARDWARE} >= {48, 63, 64, 74, 79, 92, 94, 95}
    assert classify(45).kind is XidKind.NOT_A_FAULT and not classify(45).told
    assert all(i.told for x, i in XIDS.items() if i.kind is XidKind.APPLICATION)
    assert not any(i.told for i in XIDS.values() if i.kind is XidKind.NOT_A_FAULT)
    assert classify(12345).kind is XidKind.UNKNOWN and not classify(12345).told
    assert all(x == i.xid for x, i in XIDS.items())
