"""Cold cycles made warm (issue 34): the first cycle of each pod shape filters and scores every node for it (19-27 ms
at 10,000 nodes against a warm cycle's 1-2 ms). :func:`keep_warm` fills those caches for every shape the view's pods
have, on each scheduler the decisions build (at the first pod, after a relist, after a policy swap), in slices on
the event loop so that no request waits long behind it.

It takes no policy of its own accord: a swap for a drifted workload stays the decisions' (:meth:`Schedulers.current`).
After a list (the first sync, a relist) it builds the scheduler the first filter would have built, before that
filter: with a workload given at start the same one; otherwise taken from the pods the view holds then rather than
when the first pod comes. The caches it fills hold values that depend only on a node's state and the shape, so every decision is the
same with and without warming (tests/k8s/test_k8s_extender_warm.py replays a sequence both ways).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time

from sharegpu.k8s.extender.schedulers import Schedulers
from sharegpu.placement.framework import Scheduler

log = logging.getLogger(__name__)

SLICE_NODES = 500  # nodes scored per slice: about 1-2 ms of the event loop at a time
POLL_S = 0.25  # how often a new scheduler (first pod, relist, policy swap) is looked for


def warm_all(scheduler: Scheduler, schedulers: Schedulers, chunk: int = SLICE_NODES) -> int:
    """Warm ``scheduler`` for every shape of the view's pods at once (no event loop: benches, tests); returns the
    shapes warmed."""
    reqs = schedulers.warm_requests()
    for r in reqs:
        for _ in scheduler.warm(r, chunk):
            pass
    return len(reqs)


async def keep_warm(
    schedulers: Schedulers, stop: asyncio.Event, chunk: int = SLICE_NODES, freeze: bool = False
) -> None:
    """Until ``stop``: warm each new scheduler for the view's pod shapes, one slice per event-loop turn. A slice
    computed on the loop's own thread sees the ledger as the decisions do (no lock, no torn rows); a scheduler
    replaced meanwhile is dropped and the new one warmed.

    ``freeze`` (the serving process only): once a scheduler is warm, what exists then (the view, the ledger, the
    warmed caches: long-lived) leaves the garbage collector's generations (``gc.freeze``). Full collections walked
    them 3-4 times per 1,500 pods at 120 nodes, 70-110 ms each with every request in flight waiting (issue 34).
    Frozen objects are still freed by their reference counts; only a cycle among them outlives its last use."""
    warmed: Scheduler | None = None
    while not stop.is_set():
        sched = None
        if schedulers.view.synced:
            sched = schedulers.current()
            if sched is None and not schedulers.built_on_ledger():
                # Listed (first sync or a relist) and no pod asked yet: build it now, as the first filter would,
                # so that the first pod finds it warm.
                sched = schedulers.placement()
        if sched is not None and sched is not warmed:
            started = time.perf_counter()
            reqs = schedulers.warm_requests()
            done = True
            try:
                for r in reqs:
                    for _ in sched.warm(r, chunk):
                        await asyncio.sleep(0)
                        if stop.is_set() or schedulers.current() is not sched:
                            done = False
                            break
                    if not done:
                        break
            except Exception:
                # Warming only saves time: a failure leaves the cycles cold (they compute what warming would have),
                # said once per scheduler, and the task goes on watching for the next one.
                log.exception("warming pod shapes failed; the first cycle of each shape will be cold")
                warmed = sched
                continue
            if done:
                warmed = sched
                if freeze:
                    gc.freeze()
                log.info(
                    "warmed %d pod shape(s) over %d node(s) in %.2f s",
                    len(reqs),
                    len(sched.ledger.nodes),
                    time.perf_counter() - started,
                )
            continue
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), POLL_S)
