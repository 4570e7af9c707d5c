"""``wait_for``: poll a condition that a server process makes true asynchronously."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(pred: Callable[[], T], timeout_s: float = 15.0, interval_s: float = 0.02) -> T:
    """Call ``pred`` every ``interval_s`` until it returns a truthy value or ``timeout_s`` passes.

    Returns its last value (falsy on timeout), so ``assert wait_for(...)`` fails
    with the condition still false, and a caller can use a truthy result.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(interval_s)
