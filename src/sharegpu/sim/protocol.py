"""The FGD paper's arrival protocol: seeded shuffle, tune to a load ratio, submit one by one, no departures."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import numpy as np

from sharegpu.model.request import GpuRequest
from sharegpu.model.tenant import own_tenant, user_tenant
from sharegpu.sim.openb import TraceTask

_SEED_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?")
MAX_SEEDS = 10_000  # a range beyond this is a typo (0-100000), and would be built before anything checked it


def parse_seeds(text: str) -> list[int]:
    """'42-51' → [42..51]; '42,45' → [42, 45]; '7' → [7]. A seed given twice is an error: it would run twice
    and count twice in every mean. So is an empty item ('1,,2', a trailing comma): a seed may be missing from it."""
    seeds: list[int] = []
    parts = [p.strip() for p in text.split(",")]
    if not any(parts):
        raise ValueError(f"--seeds {text!r}: no seed given; use e.g. 42 or 42-51")
    for part in parts:
        if not part:
            raise ValueError(f"--seeds {text!r}: an item between commas is empty; use e.g. 42,44 or 42-51")
        # Plain ASCII digits only: int() would also take '1_0', '+5' and non-ASCII digits.
        m = _SEED_ITEM.fullmatch(part)
        a, b = (int(m[1]), int(m[2] or m[1])) if m else (0, -1)
        if b < a:
            raise ValueError(f"--seeds {text!r}: {part!r} is not a seed or a range like 42-51")
        if len(seeds) + (b - a + 1) > MAX_SEEDS:
            raise ValueError(
                f"--seeds {text!r}: {len(seeds) + (b - a + 1):,} seeds; at most {MAX_SEEDS:,} are accepted (the FGD "
                "paper uses 10: 42-51)"
            )
        again = sorted(set(seeds) & set(range(a, b + 1)))
        if again:
            raise ValueError(f"--seeds {text!r}: seed {again[0]} is given twice; list each seed once")
        seeds.extend(range(a, b + 1))
    return seeds


def fgd_arrivals(tasks: Sequence[TraceTask], capacity_milli: int, seed: int, tune: float) -> list[GpuRequest]:
    """Pods ordered by name and shuffled with ``seed``, then grown by uniform draws (with replacement, from the
    trace before tuning) until the next draw would push the GPU asked for past ``tune`` × capacity; a trace
    already above that target loses random pods instead."""
    rng = np.random.default_rng(seed)
    base = sorted((t.request for t in tasks), key=lambda r: r.name)
    order = rng.permutation(len(base))
    pods = [base[i] for i in order]
    target = tune * capacity_milli
    total = sum(r.total_milli for r in pods)
    if total > target:
        while pods and total > target:
            victim = pods.pop(int(rng.integers(len(pods))))
            total -= victim.total_milli
        return pods
    if not any(r.total_milli for r in base):
        return pods  # nothing asks for a GPU: no draw can ever reach the target
    i = 0
    while True:
        pick = base[int(rng.integers(len(base)))]
        if total + pick.total_milli > target:
            break
        pods.append(dataclasses.replace(pick, name=f"{pick.name}-tuned-{i}"))
        total += pick.total_milli
        i += 1
    return pods


MAX_USERS = 100_000
# The share of pods that declare no Unix user, by default: most pods set no runAsUser (the image's USER decides), as
# in every pod of the rig's load tests and the docs' first examples; 0.8 leaves one pod in five declaring a user, so
# that a tenant of several pods (one namespace, one runAsUser) is still drawn. A judgement, not a measurement: no
# count of runAsUser across clusters was at hand; --undeclared gives any other share.
DEFAULT_UNDECLARED = 0.8
SIM_NAMESPACE = "sim"  # the one namespace of the drawn users' tenants (sharegpu.model.tenant.user_tenant)


def draw_tenants(
    requests: Sequence[GpuRequest], users: int, seed: int, undeclared: float = DEFAULT_UNDECLARED
) -> list[GpuRequest]:
    """Each request's MPS tenant (sharegpu.model.tenant), drawn per pod with ``seed``: with probability
    ``undeclared`` the pod declares no Unix user and is a tenant of its own (own_tenant of its name); otherwise it
    runs as one of ``users`` UIDs (1000, 1001, …, uniformly) in one namespace, and the pods of a UID are one tenant.

    The UIDs are drawn as :func:`with_users` draws them and the undeclared pods from a stream of their own, so that
    ``undeclared=0`` gives every pod the UID ``with_users`` gives it. Requests that can never be MPS clients (whole
    GPUs, CPU-only, time-slicing, isolation ``fault`` or ``hardware``) keep their tenant: it would change nothing.
    """
    if not 1 <= users <= MAX_USERS:
        raise ValueError(f"users {users} must be from 1 to {MAX_USERS:,}")
    if not 0 <= undeclared <= 1:  # also NaN
        raise ValueError(f"undeclared {undeclared!r} must be a share from 0 to 1")
    uids = np.random.default_rng([seed, 0x0515]).integers(users, size=len(requests)) + 1000
    alone = np.random.default_rng([seed, 0x0516]).random(len(requests)) < undeclared
    out = []
    for r, uid, own in zip(requests, uids.tolist(), alone.tolist(), strict=True):
        if r.may_use_mps:
            tenant = own_tenant(r.name) if own else user_tenant(SIM_NAMESPACE, uid)
            r = dataclasses.replace(r, tenant=tenant)
        out.append(r)
    return out


def with_users(requests: Sequence[GpuRequest], users: int, seed: int) -> list[GpuRequest]:
    """Each request run by one of ``users`` Unix users (UIDs 1000, 1001, …), drawn uniformly per pod with ``seed``,
    every pod declaring its user; one user (``users=1``) leaves the requests as they are (tenant None: any tenant, as
    if no rule existed). :func:`draw_tenants` also draws pods that declare no user, as the simulator does."""
    if not 1 <= users <= MAX_USERS:
        raise ValueError(f"users {users} must be from 1 to {MAX_USERS:,}")
    if users == 1:
        return list(requests)
    rng = np.random.default_rng([seed, 0x0515])
    uids = rng.integers(users, size=len(requests)) + 1000
    return [
        dataclasses.replace(r, tenant=user_tenant(SIM_NAMESPACE, int(u)))
        for r, u in zip(requests, uids.tolist(), strict=True)
    ]
