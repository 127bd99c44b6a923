"""Healing: the first restart of a failed engine at once, later ones backing off, a pause after too many failures
within the window (the refusal says how many, in what time, and the last cause), and a fresh start after it."""

from __future__ import annotations

from lmserve.parsing import format_duration
from lmserve.service.healing import FAILURE_WINDOW, MAX_FAILURES, RESTART_BACKOFF, Healing, stopped


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_key_that_never_failed_may_start_now_and_is_not_refused() -> None:
    clock = Clock()
    healing = Healing(clock)
    assert healing.restart_at("a") == clock.now
    assert not healing.is_recovering("a")
    assert healing.refusal("a", "a") is None


def test_the_first_restart_is_at_once_and_each_later_one_waits_twice_as_long() -> None:
    assert MAX_FAILURES >= 3  # room for two restarts before the pause
    clock = Clock()
    healing = Healing(clock)
    healing.failed("a", "died")
    assert healing.restart_at("a") == clock.now and healing.is_recovering("a")
    clock.now += 10
    healing.failed("a", "died again")
    assert healing.restart_at("a") == clock.now + RESTART_BACKOFF
    if MAX_FAILURES > 3:
        healing.failed("a", "and again")
        assert healing.restart_at("a") == clock.now + 2 * RESTART_BACKOFF
    assert healing.refusal("a", "a") is None
    assert healing.restart_at("b") == clock.now  # other keys are untouched


def test_max_failures_within_the_window_pause_restarts_until_the_oldest_leaves_it() -> None:
    clock = Clock()
    healing = Healing(clock)
    first = clock.now
    for i in range(MAX_FAILURES):
        assert not healing.is_pausing("a")
        healing.failed("a", f"EngineCore_DP0 process died (SIGKILL) #{i}")
        clock.now += 1
    assert healing.is_pausing("a")
    assert healing.restart_at("a") == first + FAILURE_WINDOW
    refusal = healing.refusal("smol", "a")
    assert refusal is not None and refusal.status == 503
    assert refusal.message == (
        f"the engine serving 'smol' failed {MAX_FAILURES} times within 5m "
        f"(last: EngineCore_DP0 process died (SIGKILL) #{MAX_FAILURES - 1}); lmserve stopped restarting it for now "
        f"and tries again in {format_duration(FAILURE_WINDOW - MAX_FAILURES)}: see the server log for the cause")
    clock.now = first + FAILURE_WINDOW
    assert healing.refusal("smol", "a") is None  # the oldest failure left the window: a restart may run again
    clock.now += FAILURE_WINDOW
    assert not healing.is_recovering("a")  # all forgotten


def test_the_error_of_a_request_whose_engine_stopped_says_why_and_that_it_restarts() -> None:
    error = stopped("smol", "EngineCore_DP0 process died (SIGKILL)")
    assert error.status == 503 and error.code == "engine_stopped"
    assert error.message == ("the engine serving 'smol' stopped (EngineCore_DP0 process died (SIGKILL)); it is being "
                             "restarted: retry shortly")
