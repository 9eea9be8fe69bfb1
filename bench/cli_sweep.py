"""Malformed input at `sharegpu sim` and `sharegpu trace` (issue 21): each case is expected to be refused (exit 2,
'error:' on stderr, nothing on stdout, no traceback), accepted with a warning, or accepted; no input file may change.
Prints one line per case and the count handled cleanly.

    uv run python bench/cli_sweep.py
    BIN='python|-c|from sharegpu.cli import app; app()' PYTHONPATH=OLD/src CASE_TIMEOUT=45 python bench/cli_sweep.py

BIN is the command ('|'-separated) to run instead of the installed `sharegpu`; CASE_TIMEOUT (s) ends a case that
runs on (on code that takes --seeds 0-100000 without a word), which then counts as not handled.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

# The work folder: made by main() (a --help must write nothing), read by the helpers below.
W = Path()
BIN = os.environ.get("BIN") or shutil.which("sharegpu") or "sharegpu"
NODES = "sn,cpu_milli,memory_mib,gpu,model\nn0,32000,131072,2,V100M16\nn1,32000,131072,4,T4\n"
H = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time"


def pods(n=12, dele=True, spec=""):
    return (
        H
        + "\n"
        + "".join(
            f"p{i:03d},2000,4096,1,{300 + 50 * (i % 10)},{spec},LS,Running,{10 * i},{10 * i + 95 if dele else ''}\n"
            for i in range(n)
        )
    )


def w(name, text, mode="t"):
    p = W / name
    p.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text)
    return str(p)


def setup():
    global \
        n, \
        p, \
        nbom, \
        n00, \
        n1e1, \
        n25, \
        ncol, \
        nname, \
        n0cpu, \
        pspec, \
        pcpu, \
        pbig, \
        psome, \
        pnotimes, \
        pnodel, \
        pempty, \
        phead, \
        pbytes, \
        pdup, \
        pfields, \
        pneg, \
        p1500, \
        pmulti, \
        pdelb, \
        pbom, \
        pspecsrc, \
        pe, \
        afile, \
        exist
    n = w("n.csv", NODES)
    p = w("p.csv", pods())
    w("d/report.json", pods())
    w("r.png", NODES)
    nbom = w("nbom.csv", b"\xef\xbb\xbf" + NODES.encode(), "b")
    n00 = w("n00.csv", NODES + "n2,0,0,2,T4\n")
    n1e1 = w("n1e1.csv", NODES + "n2,1000,1024,1e1,T4\n")
    n25 = w("n25.csv", NODES + "n2,1000,1024,2.5,T4\n")
    ncol = w("ncol.csv", NODES.replace("model", "model,x").replace("\n", ",1\n").replace("x,1", "x"))
    nname = w("nname.csv", NODES + ",1000,1024,1,T4\n")
    n0cpu = w("n0cpu.csv", NODES + "n2,0,1024,2,T4\n")
    pspec = w("pspec.csv", pods(spec="T4||"))
    pcpu = w(
        "pcpu.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n" + "".join(f"c{i},1000,1024,0,0\n" for i in range(5))
    )
    pbig = w(
        "pbig.csv",
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n" + "".join(f"b{i},99000,1024,1,500\n" for i in range(5)),
    )
    psome = w("psome.csv", pods(8) + "big,99000,1,1,500,,LS,Running,1,2\n")
    pnotimes = w("pnotimes.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,1024,1,500\n")
    pnodel = w("pnodel.csv", pods(6) + pods(3, dele=False).split("\n", 1)[1].replace("p00", "q00"))
    pempty = w("pempty.csv", "")
    phead = w("phead.csv", H + "\n")
    pbytes = w("pbytes.csv", (H + "\n").encode() + b"p\xff,1,1,1,500,,LS,Running,0,1\n", "b")
    pdup = w("pdup.csv", pods(3) + "p000,1,1,1,500,,LS,Running,0,1\n")
    pfields = w("pfields.csv", pods(3) + "x,1,1\n")
    pneg = w("pneg.csv", pods(3) + "x,-5,1,1,500,,LS,Running,0,1\n")
    p1500 = w("p1500.csv", pods(3) + "x,1,1,1,1500,,LS,Running,0,1\n")
    pmulti = w("pmulti.csv", pods(3) + "x,1,1,2,500,,LS,Running,0,1\n")
    pdelb = w("pdelb.csv", pods(3) + "x,1,1,1,500,,LS,Running,10,5\n")
    pbom = w("pbom.csv", b"\xef\xbb\xbf" + pods(3).encode(), "b")
    pspecsrc = w("src.csv", pods(4, spec="T4"))
    pe = w("pe.csv", pods(3) + "x,1e3,1,1,500,,LS,Running,0,1\n")
    afile = w("afile.txt", "x")
    os.makedirs(W / "adir", exist_ok=True)
    exist = w("exist.csv", "keep")


def main() -> None:
    global W
    argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        epilog="Environment: BIN (the command to run, '|'-separated; default: sharegpu) and CASE_TIMEOUT (s, default "
        "300). It works in a new folder under the system's temporary folder.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ).parse_args()
    W = Path(tempfile.mkdtemp(prefix="sharegpu-sweep-"))
    os.chdir(W)
    setup()
    T = [n, p, nbom, n00, pspec, pspecsrc, W / "d/report.json", W / "r.png", exist]
    before = {str(f): hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in T}
    S = ["sim", "--nodes", n, "--pods", p, "--jobs", "1"]
    cases = [
        ("sim --json <pods>", [*S, "--json", p], "err"),
        ("sim --json <nodes>", [*S, "--json", n], "err"),
        (
            "sim --out d (d/report.json is --pods)",
            ["sim", "--nodes", n, "--pods", str(W / "d/report.json"), "--out", "d"],
            "err",
        ),
        (
            "sim --json r.json (r.png is --nodes)",
            ["sim", "--nodes", str(W / "r.png"), "--pods", p, "--json", "r.json"],
            "err",
        ),
        ("sim --seeds 0-100000", ["sim", "--seeds", "0-100000"], "err"),
        ("sim --seeds 0-5000 (embedded)", ["sim", "--seeds", "0-5000"], "err"),
        ("sim --seeds ''", [*S, "--seeds", ""], "err"),
        ("sim --seeds 1,,2", [*S, "--seeds", "1,,2"], "err"),
        ("sim --seeds abc", [*S, "--seeds", "abc"], "err"),
        ("sim --seeds 5-1", [*S, "--seeds", "5-1"], "err"),
        ("sim --seeds 1,1", [*S, "--seeds", "1,1"], "err"),
        ("sim --seeds 99999999999999999999999", [*S, "--seeds", "99999999999999999999999", "--out", "o"], "ok"),
        ("sim --policy ''", [*S, "--policy", ""], "err"),
        ("sim --policy fgd,,bestfit", [*S, "--policy", "fgd,,bestfit"], "err"),
        ("sim --policy magic", [*S, "--policy", "magic"], "err"),
        ("sim --policy fgd,fgd", [*S, "--policy", "fgd,fgd"], "err"),
        ("sim --json x --out d", [*S, "--json", "x.json", "--out", "d2"], "err"),
        ("sim --out ''", [*S, "--out", ""], "err"),
        ("sim --json ''", [*S, "--json", ""], "err"),
        ("sim --tune 100.0001", [*S, "--tune", "100.0001"], "err"),
        ("sim --tune 0", [*S, "--tune", "0"], "err"),
        ("sim --tune -1", [*S, "--tune", "-1"], "err"),
        ("sim --tune nan", [*S, "--tune", "nan"], "err"),
        ("sim --tune abc", [*S, "--tune", "abc"], "err"),
        ("sim --jobs -1", [*S, "--jobs", "-1"], "err"),
        ("sim --replay (embedded)", ["sim", "--replay"], "err"),
        ("sim --replay, no times", ["sim", "--nodes", n, "--pods", pnotimes, "--replay"], "err"),
        (
            "sim --replay, some pods without deletion_time",
            ["sim", "--nodes", n, "--pods", pnodel, "--replay", "--out", "o"],
            "warn",
        ),
        ("nodes with a BOM", ["sim", "--nodes", nbom, "--pods", p, "--out", "o"], "ok"),
        ("pods with a BOM", ["sim", "--nodes", n, "--pods", pbom, "--out", "o"], "ok"),
        ("node 0 CPU 0 memory 2 GPUs", ["sim", "--nodes", n00, "--pods", p], "err"),
        ("node 0 CPU, GPUs", ["sim", "--nodes", n0cpu, "--pods", p, "--out", "o"], "warn"),
        ("node gpu 1e1", ["sim", "--nodes", n1e1, "--pods", p], "err"),
        ("node gpu 2.5", ["sim", "--nodes", n25, "--pods", p], "err"),
        ("pod cpu 1e3", ["sim", "--nodes", n, "--pods", pe], "err"),
        ("node unknown column", ["sim", "--nodes", ncol, "--pods", p], "err"),
        ("node empty name", ["sim", "--nodes", nname, "--pods", p], "err"),
        ("gpu_spec T4||", ["sim", "--nodes", n, "--pods", pspec], "err"),
        ("all pods CPU-only", ["sim", "--nodes", n, "--pods", pcpu], "err"),
        ("no pod fits anywhere", ["sim", "--nodes", n, "--pods", pbig], "err"),
        ("one pod fits nowhere", ["sim", "--nodes", n, "--pods", psome, "--out", "o"], "warn"),
        ("--nodes only", ["sim", "--nodes", n], "err"),
        ("--nodes missing file", ["sim", "--nodes", "missing.csv", "--pods", p], "err"),
        ("--nodes a folder", ["sim", "--nodes", "adir", "--pods", p], "err"),
        ("pods empty file", ["sim", "--nodes", n, "--pods", pempty], "err"),
        ("pods header only", ["sim", "--nodes", n, "--pods", phead], "err"),
        ("pods bytes not UTF-8", ["sim", "--nodes", n, "--pods", pbytes], "err"),
        ("pods duplicate name", ["sim", "--nodes", n, "--pods", pdup], "err"),
        ("pods wrong field count", ["sim", "--nodes", n, "--pods", pfields], "err"),
        ("pods negative cpu", ["sim", "--nodes", n, "--pods", pneg], "err"),
        ("pods gpu_milli 1500", ["sim", "--nodes", n, "--pods", p1500, "--out", "o"], "warn"),
        ("pods 2 GPUs at 500 milli", ["sim", "--nodes", n, "--pods", pmulti], "err"),
        ("pods deleted before created", ["sim", "--nodes", n, "--pods", pdelb], "err"),
        ("--json a folder", [*S, "--json", "adir"], "err"),
        ("--json under a file", [*S, "--json", "afile.txt/r.json"], "err"),
        ("--out a file", [*S, "--out", "afile.txt"], "err"),
        ("--json x.png", [*S, "--json", "x.png"], "err"),
        ("trace vary, no share", ["trace", "vary", p, "-o", "v.csv"], "err"),
        ("trace vary -o base", ["trace", "vary", p, "-o", p, "--sharing", "10", "--force"], "err"),
        (
            "trace vary -o spec-source",
            ["trace", "vary", p, "-o", pspecsrc, "--gpu-spec", "50", "--spec-source", pspecsrc, "--force"],
            "err",
        ),
        ("trace vary -o ''", ["trace", "vary", p, "-o", "", "--sharing", "10"], "err"),
        ("trace vary --sharing 120", ["trace", "vary", p, "-o", "v.csv", "--sharing", "120"], "err"),
        ("trace vary --cpu-only 100", ["trace", "vary", p, "-o", "v.csv", "--cpu-only", "100"], "err"),
        ("trace vary --seed -1", ["trace", "vary", p, "-o", "v.csv", "--sharing", "10", "--seed", "-1"], "err"),
        ("trace vary missing base", ["trace", "vary", "missing.csv", "-o", "v.csv", "--sharing", "10"], "err"),
        ("trace vary --gpu-spec, no spec anywhere", ["trace", "vary", p, "-o", "v.csv", "--gpu-spec", "30"], "err"),
        ("trace vary -o existing", ["trace", "vary", p, "-o", exist, "--sharing", "10"], "err"),
        ("trace vary -o folder", ["trace", "vary", p, "-o", "adir", "--sharing", "10"], "err"),
        ("trace describe missing", ["trace", "describe", "missing.csv"], "err"),
        ("trace describe BOM", ["trace", "describe", pbom], "ok"),
        ("trace describe T4||", ["trace", "describe", pspec], "err"),
    ]
    clean = 0
    bad = []
    changed = set()
    for name, args, want in cases:
        setup()
        try:
            r = subprocess.run(
                [*BIN.split("|"), *args],
                capture_output=True,
                text=True,
                timeout=int(os.environ.get("CASE_TIMEOUT", "300")),
            )
        except subprocess.TimeoutExpired:
            bad.append(name)
            print(f"BAD timeout {name}")
            continue
        err = " ".join(r.stderr.split())
        tb = "Traceback" in r.stdout + r.stderr
        if want == "err":
            ok = r.returncode == 2 and not tb and ("error" in err.lower()) and r.stdout.strip() == ""
        elif want == "warn":
            ok = r.returncode == 0 and not tb and "warning:" in err
        else:
            ok = r.returncode == 0 and not tb
        clean += ok
        now = {str(f): hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in T}
        if now != before:
            changed.add(name)
            ok = False
        if not ok:
            bad.append(name)
        print(f"{'OK ' if ok else 'BAD'} rc={r.returncode} {name}: {err[:230] or r.stdout.strip()[:120]}")
    print(f"\n{clean} of {len(cases)} handled cleanly; not: {bad}; inputs overwritten by: {sorted(changed)}")


if __name__ == "__main__":
    main()
