"""PynvmlApi's ctypes calls against a stand-in libnvidia-ml built from C here (no GPU needed).

pynvml sets no ``argtypes``: whatever PynvmlApi hands its wrappers reaches the C function as is, so only a real
C function shows whether a struct goes by value or by pointer. The stand-in is compiled with the system ``cc``
into tmp_path; the call runs in a subprocess because a by-value struct read as a pointer crashes the process.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SHIM_C = r"""
#include <stdint.h>
typedef struct { unsigned start, size; } placement_t;
unsigned seen_start = 999, seen_size = 999;
int nvmlDeviceCreateGpuInstanceWithPlacement(void *dev, unsigned pid, const placement_t *p, void **out) {
    seen_start = p->start;   /* a by-value struct arrives here as the address 0x<size><start>: SIGSEGV */
    seen_size = p->size;
    *out = (void *)0x1234;
    return 0;
}
"""

DRIVER = r"""
import ctypes, sys
import pynvml
from sharegpu.node.backends.nvml_api import PynvmlApi
lib = ctypes.CDLL(sys.argv[1])
pynvml.nvmlLib = lib
pynvml._nvmlGetFunctionPointer_cache.clear()
PynvmlApi().create_gi(None, 9, 4, 4)
print("seen", ctypes.c_uint.in_dll(lib, "seen_start").value, ctypes.c_uint.in_dll(lib, "seen_size").value)
"""


@pytest.fixture
def shim(tmp_path: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler (cc, gcc or clang) to build the stand-in libnvidia-ml")
    src = tmp_path / "shim.c"
    src.write_text(SHIM_C)
    lib = tmp_path / "libshim.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True)
    return lib


def test_create_gi_with_placement_passes_the_placement_by_pointer(shim: Path) -> None:
    pytest.importorskip("pynvml")
    r = subprocess.run([sys.executable, "-c", DRIVER, str(shim)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"the C side could not read the placement (rc {r.returncode}): {r.stderr[-500:]}"
    assert r.stdout.split() == ["seen", "4", "4"]


EVENTS_C = r"""
#include <string.h>
typedef struct { void *device; unsigned long long eventType, eventData; unsigned gpuInstanceId, computeInstanceId; } event_t;
typedef struct { unsigned pid; unsigned long long used; unsigned gi, ci; } proc_t;
static int pending = 2;
unsigned long long registered_types = 0;
void *registered_dev = 0;
int freed = 0;
int nvmlEventSetCreate(void **set) { *set = (void *)0x5e7; return 0; }
int nvmlDeviceRegisterEvents(void *dev, unsigned long long types, void *set) {
    if (set != (void *)0x5e7) return 2;
    registered_dev = dev; registered_types = types; return 0;
}
int nvmlEventSetWait_v2(void *set, event_t *data, unsigned timeout) {
    if (set != (void *)0x5e7 || timeout != 0) return 2;
    if (pending == 0) return 10;  /* NVML_ERROR_TIMEOUT: nothing queued */
    data->device = (void *)(pending == 2 ? 0xd0 : 0xd1);
    data->eventType = 8;
    data->eventData = pending == 2 ? 31 : 79;
    data->gpuInstanceId = pending == 2 ? 3 : 0xFFFFFFFFu;
    data->computeInstanceId = 0;
    pending--;
    return 0;
}
int nvmlDeviceGetUUID(void *dev, char *buf, unsigned len) {
    strncpy(buf, dev == (void *)0xd0 ? "GPU-d0" : "GPU-d1", len); return 0;
}
int nvmlEventSetFree(void *set) { freed += set == (void *)0x5e7; return 0; }
const char *nvmlErrorString(int r) { return r == 10 ? "Timeout" : "Unknown Error"; }
int nvmlDeviceGetMPSComputeRunningProcesses_v3(void *dev, unsigned *count, proc_t *procs) {
    if (procs == 0 || *count < 2) { *count = 2; return 7; }  /* NVML_ERROR_INSUFFICIENT_SIZE */
    procs[0].pid = 503; procs[0].used = 500ull << 20; procs[0].gi = 0xFFFFFFFFu;
    procs[1].pid = 504; procs[1].used = 730ull << 20; procs[1].gi = 2;
    *count = 2;
    return 0;
}
"""

EVENTS_DRIVER = r"""
import ctypes, json, sys
import pynvml
from sharegpu.node.backends.nvml_api import XID_CRITICAL_ERROR, PynvmlApi
lib = ctypes.CDLL(sys.argv[1])
pynvml.nvmlLib = lib
pynvml._nvmlGetFunctionPointer_cache.clear()
api = PynvmlApi()
es = api.event_set()
api.register_events(ctypes.c_void_p(0xd0), XID_CRITICAL_ERROR, es)
events = [api.wait_event(es, 0) for _ in range(3)]
api.free_event_set(es)
procs = api.mps_processes(ctypes.c_void_p(0xd0))
print(json.dumps({
    "types": ctypes.c_ulonglong.in_dll(lib, "registered_types").value,
    "dev": ctypes.c_void_p.in_dll(lib, "registered_dev").value,
    "freed": ctypes.c_int.in_dll(lib, "freed").value,
    "events": [None if e is None else [e.gpu_uuid, e.event_type, e.data, e.gpu_instance_id] for e in events],
    "procs": [[p.pid, p.used_bytes, p.gpu_instance_id] for p in procs],
}))
"""


def test_xid_events_and_the_mps_query_through_pynvml(tmp_path: Path) -> None:
    """Event sets and the MPS-aware process query as pynvml calls them: a timeout is "nothing", not an error."""
    pytest.importorskip("pynvml")
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler (cc, gcc or clang) to build the stand-in libnvidia-ml")
    (tmp_path / "events.c").write_text(EVENTS_C)
    lib = tmp_path / "libevents.so"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "events.c")], check=True, capture_output=True
    )
    r = subprocess.run([sys.executable, "-c", EVENTS_DRIVER, str(lib)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-800:]
    out = json.loads(r.stdout)
    assert out["types"] == 8 and out["dev"] == 0xD0 and out["freed"] == 1
    assert out["events"] == [["GPU-d0", 8, 31, 3], ["GPU-d1", 8, 79, None], None]
    assert out["procs"] == [[503, 500 << 20, None], [504, 730 << 20, 2]]
