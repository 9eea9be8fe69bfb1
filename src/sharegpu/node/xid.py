"""Which Xid errors are faults a tenant should hear about: the one table the node's fault telling reads.

NVML reports every Xid the driver logs as a "critical Xid error" event, whatever it means. Some are a fault of a
process's own (an application fault: under MPS it ends every client of that process's server), some the GPU's
memory, links, bus or firmware failing (hardware: the processes on the GPU may be ended and the GPU may need a reset),
and some are no fault at all: Xid 45 is the driver tearing down the channels of a process that ended or was killed
(a deleted pod, a Ctrl-C, the follow-up of another fault), Xid 154 says which recovery action the GPU needs now.
Only an Xid that ends processes is told to the pods of its unit (:attr:`XidInfo.told`); a hardware Xid that ends
none (a row remapping recorded for the next reset, a high rate of corrected errors) is the operator's: it is counted
(``sharegpu_gpu_xid_errors_total``) and logged.

Sources: NVIDIA's Xid catalogue (docs.nvidia.com/deploy/xid-errors, "Analyzing Xid Errors with the Xid Catalog":
each Xid's mnemonic, description and immediate action), and the application-error list NVIDIA's Kubernetes device
plugin keeps from it (13, 31, 43, 45, 68: "the GPU should still be healthy"; 45 being the cleanup, not an error of
its own). An Xid missing here is counted and logged, never told to a tenant: a number the table does not know cannot
say that anyone's clients ended (an MPS fault is also told by its server's log lines and by its server ending:
:mod:`sharegpu.node.mps_faults`; driver 580 on the H200 reported no Xid for a client's fault at all).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class XidKind(StrEnum):
    APPLICATION = "application"  # a process's own fault: under MPS, every client of its server ends
    HARDWARE = "hardware"  # the GPU's memory, links, bus or firmware: its processes may end, it may need a reset
    NOT_A_FAULT = "not-a-fault"  # the driver cleaning up or reporting state: nobody's clients ended by it
    UNKNOWN = "unknown"  # not in the table: counted and logged only


@dataclass(frozen=True, slots=True)
class XidInfo:
    xid: int
    kind: XidKind
    what: str  # NVIDIA's description, shortened
    told: bool = True  # it ends processes: the pods of its unit hear of it (an MPS fault Event)

    def describe(self) -> str:
        """``Xid 31 (GPU memory page fault; application)``, for logs and Events."""
        return f"Xid {self.xid} ({self.what}; {self.kind.value})"


_A, _H, _N = XidKind.APPLICATION, XidKind.HARDWARE, XidKind.NOT_A_FAULT
XIDS: Mapping[int, XidInfo] = {
    x.xid: x
    for x in (
        XidInfo(8, _A, "GPU stopped processing: a channel timed out"),
        XidInfo(13, _A, "graphics engine exception: e.g. an out-of-range access in a kernel"),
        XidInfo(31, _A, "GPU memory page fault: an illegal address"),
        XidInfo(43, _A, "GPU stopped processing: a user application's fault"),
        XidInfo(45, _N, "preemptive cleanup: the driver ending a process's channels once it ended", False),
        XidInfo(48, _H, "double-bit ECC error"),
        XidInfo(62, _H, "internal micro-controller halt"),
        XidInfo(63, _H, "ECC page retirement or row remapping recorded: reset the GPU to apply it", False),
        XidInfo(64, _H, "ECC page retirement or row remapping failed"),
        XidInfo(68, _A, "video processor exception"),
        XidInfo(69, _A, "graphics engine class error"),
        XidInfo(74, _H, "NVLink error"),
        XidInfo(79, _H, "the GPU has fallen off the bus"),
        XidInfo(92, _H, "high single-bit (corrected) ECC error rate", False),
        XidInfo(94, _H, "contained ECC error: the processes that used the memory are ended"),
        XidInfo(95, _H, "uncontained ECC error: every process on the GPU is ended, the GPU needs a reset"),
        XidInfo(119, _H, "GSP RPC timeout"),
        XidInfo(120, _H, "GSP error"),
        XidInfo(154, _N, "GPU recovery action changed: what the GPU needs now (reset, reboot)", False),
    )
}


def classify(xid: int) -> XidInfo:
    """The table's entry for ``xid``; an unknown number is :attr:`XidKind.UNKNOWN`, told to nobody."""
    return XIDS.get(xid) or XidInfo(xid, XidKind.UNKNOWN, "not in sharegpu's Xid table", False)
