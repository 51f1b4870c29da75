"""Waiting for a condition in end-to-end tests: poll it with a timeout, never sleep a fixed time."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout_s: float, what: str | Callable[[], str],
               poll_s: float = 0.05) -> T:
    """Calls ``condition`` every ``poll_s`` seconds until it returns something truthy, and returns that.

    Raises AssertionError naming ``what`` (a text, or a function giving one at the time of the failure)
    and the last value seen after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {text} (last: {value!r})")
        time.sleep(poll_s)
