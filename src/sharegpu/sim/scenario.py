"""The embedded default scenario: a generated mixed cluster and a mixed workload, fixed by a seed.

Cluster (64 nodes): 16 × 8 H100-80GB and 16 × 8 A100-40GB (MIG-capable), 16 × 4 V100-32GB, 8 × 2 T4 and
8 × 4 P100 (older, no MIG; P100 has no usable MPS either).

Workload (drawn per task, seed-fixed; GPU memory is per GPU):
- 30 % whole-GPU training: 1 GPU (60 %), 2 (20 %), 4 (12 %) or 8 (8 %) GPUs, exclusive;
- 30 % MPS inference shares: memory isolation, 10–50 % of a GPU's compute, 4–24 GiB;
- 20 % time-sliced notebooks/dev: isolation none, 10–50 % compute, no memory asked;
- 15 % hardware-isolated (MIG) services: 5–40 GiB, 1/7–3/7 of a GPU, only on MIG-capable models;
- 5 % CPU-only pods (they still take CPU and memory on GPU nodes).
CPU is 2–16 cores and host memory 8–64 GiB per task.
"""

from __future__ import annotations

import numpy as np

from sharegpu.model.catalog import GIB
from sharegpu.model.inventory import NodeSpec, sim_gpus
from sharegpu.model.request import GpuRequest, Isolation, Sharing

CLUSTER = (
    # (prefix, count, gpus, model, cpu cores, memory GiB)
    ("h100", 16, 8, "H100-80GB", 192, 2048),
    ("a100", 16, 8, "A100-40GB", 128, 1024),
    ("v100", 16, 4, "V100-32GB", 64, 512),
    ("t4", 8, 2, "T4", 32, 256),
    ("p100", 8, 4, "P100", 48, 384),
)
MIG_MODELS = frozenset({"H100-80GB", "A100-40GB", "A100-80GB", "H200-141GB", "A30-24GB"})
DEFAULT_TASKS = 1_500
# Twenty seeds, not three: policies within a point of each other swap places from seed to seed on a cluster this
# small (three seeds put `sharegpu` 0.34 pp behind `fgd`; over twenty it is ahead, see BENCHMARKS.md), and the
# table shows the spread over them and the two policies compared seed by seed. About 20-30 s on 2 cores.
DEFAULT_SEEDS = tuple(range(1, 21))
# The 1,500 tasks ask for more than 1.3 × capacity, so the FGD protocol drops random tasks until the demand is at
# most tune × capacity: it can end one task short of it, and this scenario's largest task (8 GPUs) is 2.2 % of its
# 368 GPUs, so at tune 1.3 two seeds in twenty never reached arrived 130 %. At 1.35 every seed passes 130 %.
DEFAULT_TUNE = 1.35
DEFAULT_POLICIES = ("random", "bestfit", "packing", "fgd", "sharegpu")


def scenario_nodes() -> list[NodeSpec]:
    nodes = []
    for prefix, count, gpus, model, cores, mem_gib in CLUSTER:
        for i in range(count):
            name = f"{prefix}-{i:02d}"
            nodes.append(NodeSpec(name, cores * 1000, mem_gib * GIB, sim_gpus(name, model, gpus)))
    return nodes


def scenario_tasks(n: int = DEFAULT_TASKS, seed: int = 0) -> list[GpuRequest]:
    rng = np.random.default_rng(seed)
    out: list[GpuRequest] = []
    for i in range(n):
        kind = rng.choice(5, p=[0.30, 0.30, 0.20, 0.15, 0.05])
        cpu = int(rng.integers(2, 17)) * 1000
        mem = int(rng.integers(8, 65)) * GIB
        name = f"task-{i:05d}"
        if kind == 0:
            gpus = int(rng.choice([1, 2, 4, 8], p=[0.6, 0.2, 0.12, 0.08]))
            out.append(GpuRequest(name, gpus, cpu_milli=cpu * gpus, host_memory_mib=mem * gpus))
        elif kind == 1:
            out.append(
                GpuRequest(
                    name,
                    1,
                    compute_milli=int(rng.integers(1, 6)) * 100,
                    memory_mib=int(rng.integers(4, 25)) * GIB,
                    isolation=Isolation.MEMORY,
                    cpu_milli=cpu,
                    host_memory_mib=mem,
                )
            )
        elif kind == 2:
            out.append(
                GpuRequest(
                    name,
                    1,
                    compute_milli=int(rng.integers(1, 6)) * 100,
                    sharing=Sharing.AUTO,
                    cpu_milli=cpu,
                    host_memory_mib=mem,
                )
            )
        elif kind == 3:
            slices = int(rng.integers(1, 4))
            out.append(
                GpuRequest(
                    name,
                    1,
                    compute_milli=slices * 1000 // 7,
                    memory_mib=int(rng.integers(5, 41)) * GIB,
                    isolation=Isolation.HARDWARE,
                    allowed_models=MIG_MODELS,
                    cpu_milli=cpu,
                    host_memory_mib=mem,
                )
            )
        else:
            out.append(GpuRequest(name, 0, cpu_milli=cpu, host_memory_mib=mem))
    return out
