"""A watch's body read as lines of bytes (``sharegpu.kube.client._lines``), however the server's chunks cut them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from hypothesis import given
from hypothesis import strategies as st

from sharegpu.kube.client import _lines

events = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["ADDED", "MODIFIED", "DELETED"]), "object": st.dictionaries(st.text(), st.text())}
    ),
    max_size=8,
)


async def _chunks(body: bytes, cuts: list[int]) -> AsyncIterator[bytes]:
    start = 0
    for cut in [*sorted({c % (len(body) + 1) for c in cuts}), len(body)]:
        yield body[start:cut]
        start = cut


async def _read(body: bytes, cuts: list[int]) -> list[bytes]:
    return [line async for line in _lines(_chunks(body, cuts))]


@given(events, st.lists(st.integers(min_value=0), max_size=12), st.booleans())
def test_every_event_comes_out_whole_whatever_the_chunks(
    evs: list[dict[str, object]], cuts: list[int], last_newline: bool
) -> None:
    # json.dumps escapes control characters, so a newline in a value never splits an event (as the API server's).
    body = b"\n".join(json.dumps(e).encode() for e in evs) + (b"\n" if last_newline and evs else b"")
    lines = asyncio.run(_read(body, cuts))
    assert [json.loads(line) for line in lines] == evs


def test_blank_lines_and_a_last_line_without_its_newline() -> None:
    body = b'\n{"type": "ADDED"}\n\n{"type": "DELETED"}'
    assert asyncio.run(_read(body, [3, 4, 20])) == [b'{"type": "ADDED"}', b'{"type": "DELETED"}']
