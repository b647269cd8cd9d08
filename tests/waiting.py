"""Waiting in tests for something another thread or process does: poll the condition up to a deadline.

A fixed sleep either wastes time (the event came early) or fails on a loaded machine (it came late); a poll
returns as soon as the condition holds, and its deadline only bounds how long a broken run hangs, so deadlines
here are generous.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.02  # short against the events waited for (tens of ms and up), long enough not to load a busy machine


def wait_until(cond: Callable[[], T], timeout_s: float, what: str, poll_s: float = POLL_S) -> T:
    """Poll ``cond`` until it returns a truthy value, and return that value.

    Args:
        cond: the condition; called once more at the deadline, so a slow last poll is not lost.
        timeout_s: how long to wait at most.
        what: what is waited for, named in the failure.
        poll_s: the pause between two polls.

    Returns:
        The first truthy value ``cond`` returned.

    Raises:
        AssertionError: ``cond`` stayed falsy for ``timeout_s``.
    """
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(poll_s)
    got = cond()
    if got:
        return got
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
