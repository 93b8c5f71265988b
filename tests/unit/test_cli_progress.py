"""The run bar's poll: an evaluation shorter than a poll must still reach the bar (the CLI's pty tests stop a
run while it reads "evaluating v0"; a CI machine fast enough to finish the evaluation between two polls
never showed it)."""

from __future__ import annotations

import threading
import time

from loopline import activity
from loopline.cli_progress import _wait


def test_an_activity_that_begins_ends_the_wait_at_once():
    stop = threading.Event()
    threading.Timer(0.2, activity.report, ("evaluating v0", 0, 200)).start()
    started = time.monotonic()
    try:
        assert _wait(stop, 30.0) is False
        assert time.monotonic() - started < 2.0
    finally:
        activity.clear("evaluating v0")


def test_an_activity_that_ends_ends_the_wait_and_stop_is_reported():
    activity.report("evaluating v4", 3, 200)
    threading.Timer(0.2, activity.clear, ("evaluating v4",)).start()
    started = time.monotonic()
    assert _wait(threading.Event(), 30.0) is False and time.monotonic() - started < 2.0
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    assert _wait(stop, 30.0) is True
    assert _wait(threading.Event(), 0.3) is False  # nothing happened: the poll's own period
