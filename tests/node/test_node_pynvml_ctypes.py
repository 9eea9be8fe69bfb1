"""PynvmlApi's ctypes calls against a stand-in libnvidia-ml built from C here (no GPU needed).

pynvml sets no ``argtypes``: whatever PynvmlApi hands its wrappers reaches the C function as is, so only a real
C function shows whether a struct goes by value or by pointer. The stand-in is compiled with the system ``cc``
into tmp_path; the call runs in a subprocess because a by-value struct read as a pointer crashes the process.
"""

from __future__ import annotations

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
from sharegpu.node.backends.nvml import PynvmlApi
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
