"""A pod's GPU request is read once and kept while what it reads stays the same (issue 34: five reads per pod).

``same_request`` must never call two copies the same when ``pod_request`` reads them differently: the property
below changes each thing the parser reads, one or several at a time, and checks the keep decision against a fresh
read.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from k8s_helpers import pod_obj

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.pod_request import pod_request, same_request
from sharegpu.kube.schema import Pod
from sharegpu.model.request import InvalidRequest


def _read(pod: Pod) -> object:
    try:
        return pod_request(pod)
    except InvalidRequest as e:
        return ("invalid", str(e))


def _container(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["containers"][0]  # type: ignore[no-any-return]


def _limits(obj: dict[str, Any]) -> dict[str, Any]:
    return _container(obj)["resources"]["limits"]  # type: ignore[no-any-return]


# Each edit changes one thing pod_request reads (or one it does not: the last four), in place.
EDITS: dict[str, Any] = {
    "memory": lambda o, v: _limits(o).__setitem__("sharegpu.io/gpu-memory", v),
    "compute": lambda o, v: _limits(o).__setitem__("sharegpu.io/gpu-compute", v),
    "gpus": lambda o, v: _limits(o).__setitem__("sharegpu.io/gpu", v),
    "cpu": lambda o, v: _container(o)["resources"]["requests"].__setitem__("cpu", v),
    "isolation": lambda o, v: o["metadata"]["annotations"].__setitem__("sharegpu.io/isolation", v),
    "sharing": lambda o, v: o["metadata"]["annotations"].__setitem__("sharegpu.io/sharing", v),
    "mig": lambda o, v: o["metadata"]["annotations"].__setitem__("sharegpu.io/mig-profile", v),
    "model": lambda o, v: o["metadata"]["annotations"].__setitem__("sharegpu.io/gpu-model", v),
    "pod_user": lambda o, v: o["spec"].__setitem__("securityContext", {"runAsUser": v}),
    "container_user": lambda o, v: _container(o).__setitem__("securityContext", {"runAsUser": v}),
    "host_users": lambda o, v: o["spec"].__setitem__("hostUsers", v),
    "overhead": lambda o, v: o["spec"].__setitem__("overhead", {"cpu": v}),
    "init": lambda o, v: o["spec"].__setitem__(
        "initContainers", [{"name": "init", "resources": {"limits": {"sharegpu.io/gpu": v}}}]
    ),
    "uid": lambda o, v: o["metadata"].__setitem__("uid", v),
    "resource_version": lambda o, v: o["metadata"].__setitem__("resourceVersion", v),
    "node_name": lambda o, v: o["spec"].__setitem__("nodeName", v),
    "phase": lambda o, v: o["status"].__setitem__("phase", v),
    "other_annotation": lambda o, v: o["metadata"]["annotations"].__setitem__("sharegpu.io/assignment", v),
}
VALUES: dict[str, Any] = {
    "memory": st.sampled_from(["2Gi", "4Gi", "10", "ten"]),
    "compute": st.sampled_from(["10", "30", "150"]),
    "gpus": st.sampled_from(["1", "2", "0"]),
    "cpu": st.sampled_from(["1", "2", "500m"]),
    "isolation": st.sampled_from(["none", "memory", "hardware", "fault"]),
    "sharing": st.sampled_from(["auto", "mps", "time-slicing", "mig"]),
    "mig": st.sampled_from(["1g.10gb", "3g.40gb", ""]),
    "model": st.sampled_from(["A100-80GB", "H100-80GB", "nope"]),
    "pod_user": st.sampled_from([0, 1000, 1001]),
    "container_user": st.sampled_from([0, 1000, 1001]),
    "host_users": st.sampled_from([True, False]),
    "overhead": st.sampled_from(["100m", "1"]),
    "init": st.sampled_from(["0", "1"]),
    "uid": st.sampled_from(["uid-a", "uid-b"]),
    "resource_version": st.sampled_from(["2", "3"]),
    "node_name": st.sampled_from(["n1", "n2"]),
    "phase": st.sampled_from(["Running", "Succeeded"]),
    "other_annotation": st.sampled_from(["{}", "x"]),
}

edits = st.lists(st.sampled_from(sorted(EDITS)), max_size=4).flatmap(
    lambda names: st.tuples(*(st.tuples(st.just(n), VALUES[n]) for n in names))
)


def _edited(base: dict[str, Any], changes: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    obj = copy.deepcopy(base)
    for name, value in changes:
        EDITS[name](obj, value)
    return obj


@settings(max_examples=400, deadline=None)
@given(before=edits, after=edits, same_version=st.booleans())
def test_a_kept_request_is_the_one_a_fresh_read_gives(
    before: tuple[tuple[str, Any], ...], after: tuple[tuple[str, Any], ...], same_version: bool
) -> None:
    base = pod_obj("p", memory="4Gi", compute=10)
    a = _edited(base, before)
    b = _edited(a, after)
    if not same_version:
        b["metadata"]["resourceVersion"] = a["metadata"]["resourceVersion"] + "0"
    elif b != a:
        return  # one resourceVersion names one content on the API server: no such pair exists
    pa, pb = Pod.model_validate(a), Pod.model_validate(b)
    if same_request(pa, pb):
        assert _read(pa) == _read(pb)


def test_what_a_bind_changes_keeps_the_request_and_a_resize_reads_it_again() -> None:
    view = ClusterView()
    obj = pod_obj("p", memory="4Gi", compute=10)
    view.apply_pod("ADDED", Pod.model_validate(obj))
    first = view.request("default/p")
    assert first is not None

    bound = copy.deepcopy(obj)
    bound["metadata"]["resourceVersion"] = "2"
    bound["spec"]["nodeName"] = "n1"
    bound["metadata"]["annotations"]["sharegpu.io/assignment"] = "{}"
    view.apply_pod("MODIFIED", Pod.model_validate(bound))
    assert view.request("default/p") is first  # kept, not read again

    resized = copy.deepcopy(bound)
    resized["metadata"]["resourceVersion"] = "3"
    resized["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "3"
    view.apply_pod("MODIFIED", Pod.model_validate(resized))
    again = view.request("default/p")
    assert again is not None and again is not first and again.cpu_milli == 3000


def test_filter_and_bind_take_the_views_request_for_the_version_it_holds() -> None:
    view = ClusterView()
    obj = pod_obj("p", memory="4Gi", compute=10, run_as_user=1000)
    view.apply_pod("ADDED", Pod.model_validate(obj))
    held = view.request("default/p")
    assert view.request_of(Pod.model_validate(obj)) is held  # the scheduler's copy of the same version

    other_user = copy.deepcopy(obj)
    other_user["metadata"]["resourceVersion"] = "9"
    other_user["spec"]["securityContext"] = {"runAsUser": 1001}
    fresh = view.request_of(Pod.model_validate(other_user))
    assert fresh is not None and fresh is not held and fresh.tenant != held.tenant  # type: ignore[union-attr]
