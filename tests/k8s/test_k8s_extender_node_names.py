"""The node list recognised by its bytes (sharegpu.k8s.extender.node_names, issue 34): whatever the bodies, the
decoder gives what a whole decode gives, and the scheduler's repeated list is given back as the same object."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from k8s_helpers import pod_obj
from pydantic import ValidationError

from sharegpu.k8s.extender.node_names import ArgsDecoder
from sharegpu.kube.schema import ExtenderArgs

BIG = [f"node-{i:05d}" for i in range(2000)]


def _body(pod: dict[str, Any], names: list[str] | None, order: str = "go") -> bytes:
    members: list[tuple[str, Any]] = [("Pod", pod), ("Nodes", None), ("NodeNames", names)]
    if order == "names-first":
        members = [members[2], members[0], members[1]]
    return json.dumps(dict(members), separators=(",", ":")).encode()


def test_the_repeated_list_is_the_same_object_and_each_pod_its_own() -> None:
    d = ArgsDecoder()
    first = d.decode(_body(pod_obj("a"), BIG))
    second = d.decode(_body(pod_obj("b", memory="4Gi"), BIG))
    assert first.NodeNames == BIG and second.NodeNames is first.NodeNames
    assert (first.Pod.metadata.name, second.Pod.metadata.name) == ("a", "b")
    assert second.model_dump() == ExtenderArgs.model_validate_json(_body(pod_obj("b", memory="4Gi"), BIG)).model_dump()


def test_a_changed_list_is_decoded_again() -> None:
    d = ArgsDecoder()
    d.decode(_body(pod_obj("a"), BIG))
    fewer = BIG[1:]
    got = d.decode(_body(pod_obj("a"), fewer))
    assert got.NodeNames == fewer


def test_a_malformed_body_ending_in_the_known_list_fails_as_a_whole_decode_does() -> None:
    d = ArgsDecoder()
    d.decode(_body(pod_obj("a"), BIG))
    bad = b'{"Pod":{"metadata":' + _body(pod_obj("a"), BIG)[len(b'{"Pod":') :].split(b',"Nodes"', 1)[1]
    with pytest.raises(ValidationError):
        ExtenderArgs.model_validate_json(bad)
    with pytest.raises(ValidationError):
        d.decode(bad)
    no_pod = b'{"Nodes":null,' + _body(pod_obj("a"), BIG).split(b'"Nodes":null,', 1)[1]
    with pytest.raises(ValidationError):
        d.decode(no_pod)


tricky_keys = st.sampled_from(["NodeNames", '"NodeNames":', "x", "]}", '"NodeNames":[]}'])


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),
            st.dictionaries(tricky_keys, tricky_keys, max_size=2),
            st.sampled_from(["big", "fewer", "none", "small"]),
            st.sampled_from(["go", "names-first"]),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_any_sequence_of_bodies_decodes_as_whole_decodes_do(steps: list[tuple[str, dict[str, str], str, str]]) -> None:
    lists: dict[str, list[str] | None] = {"big": BIG, "fewer": BIG[:-1], "none": None, "small": ["n1", "n2"]}
    d = ArgsDecoder()
    for name, ann, which, order in steps:
        body = _body(pod_obj(name, annotations=ann), lists[which], order)
        assert d.decode(body).model_dump() == ExtenderArgs.model_validate_json(body).model_dump()
