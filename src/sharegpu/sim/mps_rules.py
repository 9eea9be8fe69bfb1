"""Which MPS tenancy rule a simulation applies (issue 32): who may share an MPS unit, and what its daemons cost.

A trace says nothing about who its pods run as, so the simulator draws each pod's tenant (sim.protocol.draw_tenants)
and places under one of four rules:

- ``none``: no rule: every pod's MPS share joins the one daemon of any MPS unit (the tenant left unset), the
  baseline the others are measured against;
- ``one-user``: one daemon per unit (MpsTenancy(daemons_per_unit=1)), the cap of the rule before issue 32: a unit
  serves the pods of one tenant only, and a pod that declares no user holds the unit it opens alone. It is not that
  rule exactly: placement now opens an idle GPU as MPS for an undeclared ``isolation: none`` share too (which then
  holds it alone), where the rule before time-sliced such a share (BENCHMARKS.md "MPS tenancy" measures both);
- ``per-tenant``: a daemon per (unit, tenant), at most ``--mps-daemons-per-gpu`` a unit (default 16), what sharegpu
  does;
- ``multi-user``: every node in multi-user mode (NodeSpec.mps_multi_user): one daemon per unit for every tenant.

Every rule counts each daemon's own GPU memory (MpsTenancy.daemon_memory_mib, 66 MiB as measured on an H200;
``--mps-daemon-memory``): under ``none`` and ``multi-user`` a unit runs one daemon, under the others one per tenant.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from enum import StrEnum

from sharegpu.ledger import DEFAULT_DAEMONS_PER_UNIT, MPS_DAEMON_MEMORY_MIB, MpsTenancy
from sharegpu.model.inventory import NodeSpec
from sharegpu.model.request import GpuRequest
from sharegpu.sim.protocol import DEFAULT_UNDECLARED, draw_tenants


class MpsRule(StrEnum):
    NONE = "none"
    ONE_USER = "one-user"
    PER_TENANT = "per-tenant"
    MULTI_USER = "multi-user"

    @property
    def draws_tenants(self) -> bool:
        """Whether the pods' drawn users change anything under this rule (not when every tenant shares a daemon)."""
        return self in (MpsRule.ONE_USER, MpsRule.PER_TENANT)

    def describe(self, daemons_per_gpu: int = DEFAULT_DAEMONS_PER_UNIT) -> str:
        return {
            MpsRule.NONE: "no rule (one daemon a unit, any pod joins)",
            MpsRule.ONE_USER: "one tenant a unit (the cap before issue 32, with today's mechanism choice)",
            MpsRule.PER_TENANT: f"a daemon per tenant (at most {daemons_per_gpu} a unit)",
            MpsRule.MULTI_USER: "multi-user (one -M daemon a unit for every tenant)",
        }[self]


DEFAULT_RULE = MpsRule.PER_TENANT  # the CLI's: what sharegpu does
ALL_RULES = tuple(MpsRule)


class UnknownRule(ValueError):
    pass


def parse_rules(text: str) -> tuple[MpsRule, ...]:
    """'per-tenant' → (PER_TENANT,); 'none,per-tenant' → both in that order; 'all' → every rule, ``none`` first."""
    names = ", ".join(r.value for r in MpsRule)
    parts = [p.strip() for p in text.split(",")]
    if not any(parts):
        raise UnknownRule(f"--mps-rule {text!r} names no rule; choose from: {names}, or all")
    if parts == ["all"]:
        return ALL_RULES
    out: list[MpsRule] = []
    for part in parts:
        if not part:
            raise UnknownRule(f"--mps-rule {text!r}: an item between commas is empty; e.g. --mps-rule none,per-tenant")
        try:
            rule = MpsRule(part)
        except ValueError:
            raise UnknownRule(f"--mps-rule {text!r}: {part!r} is not a rule; choose from: {names}, or all") from None
        if rule in out:
            raise UnknownRule(f"--mps-rule {text!r} names {rule} more than once; list each rule once")
        out.append(rule)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class MpsSetup:
    """One rule with its figures: what the ledger counts and whom the pods run as."""

    rule: MpsRule = MpsRule.NONE
    daemons_per_gpu: int = DEFAULT_DAEMONS_PER_UNIT  # per-tenant's cap
    users: int = 1  # UIDs the pods that declare a user are drawn among
    undeclared: float = DEFAULT_UNDECLARED  # share of pods that declare no user: each a tenant of its own
    daemon_memory_mib: int = MPS_DAEMON_MEMORY_MIB  # GPU memory each daemon's server takes, under every rule

    def tenancy(self) -> MpsTenancy:
        memory = self.daemon_memory_mib
        if self.rule is MpsRule.ONE_USER:
            return MpsTenancy(daemons_per_unit=1, daemon_memory_mib=memory)
        if self.rule is MpsRule.PER_TENANT:
            return MpsTenancy(daemons_per_unit=self.daemons_per_gpu, daemon_memory_mib=memory)
        return MpsTenancy(daemon_memory_mib=memory)  # none and multi-user run one daemon a unit: no cap binds

    def nodes(self, nodes: Sequence[NodeSpec]) -> tuple[NodeSpec, ...]:
        if self.rule is MpsRule.MULTI_USER:
            return tuple(n if n.mps_multi_user else dataclasses.replace(n, mps_multi_user=True) for n in nodes)
        return tuple(nodes)

    def requests(self, requests: Sequence[GpuRequest], seed: int) -> list[GpuRequest]:
        """``requests`` with their tenants as this rule sees them: drawn with ``seed``, or left as the trace has them
        (any tenant) where every tenant shares one daemon (none, multi-user: drawing them would change nothing)."""
        if not self.rule.draws_tenants:
            return list(requests)
        return draw_tenants(requests, self.users, seed, self.undeclared)

    def label(self) -> str:
        who = f", {self.users} user{'s' if self.users != 1 else ''}, {self.undeclared:.0%} undeclared"
        memory = f", {self.daemon_memory_mib} MiB a daemon" if self.daemon_memory_mib != MPS_DAEMON_MEMORY_MIB else ""
        return f"MPS: {self.rule.describe(self.daemons_per_gpu)}{who if self.rule.draws_tenants else ''}{memory}"


def run_label(policy: str, rule: str | None) -> str:
    """A run's name where several MPS rules ran (progress lines, the plot's lines): its policy and its rule."""
    return policy if rule is None else f"{policy} [{rule}]"
