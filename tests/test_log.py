"""thing.log.LogOnce: a message of each kind once (or once a period), bounded memory."""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace

import pytest

from thing.log import WARNING, LogOnce


def _logged(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno == level]


def test_each_kind_is_logged_once_and_its_repeats_cost_no_record(caplog) -> None:
    """A catch that fails at every step logs once: not a debug record a step either."""
    caplog.set_level(logging.DEBUG, logger="thing")
    warn_once = LogOnce()
    for attempt in range(3):
        warn_once("lost", WARNING, "lost the server: %s", attempt)
        warn_once("refused", WARNING, "refused: %s", attempt)
    assert [record.getMessage() for record in caplog.records] == ["lost the server: 0",
                                                                  "refused: 0"]


def _clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """thing.log's clock, set by hand (its own only: the module is shadowed by its logger
    as an attribute of thing)."""
    now = [1000.0]
    monkeypatch.setattr(sys.modules["thing.log"], "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def test_a_period_lets_a_kind_be_logged_again_once_it_has_passed(caplog, monkeypatch) -> None:
    caplog.set_level(logging.WARNING, logger="thing")
    now = _clock(monkeypatch)
    warn_rarely = LogOnce(per=60)
    for step in range(5):  # every 30 s: logged at 0, 60 and 120 s
        warn_rarely("lost", WARNING, "lost at %d s", 30 * step)
        now[0] += 30
    assert _logged(caplog, logging.WARNING) == ["lost at 0 s", "lost at 60 s", "lost at 120 s"]


def test_memory_and_log_are_bounded_whatever_the_keys(caplog, monkeypatch) -> None:
    """Keys made of names (a catch failing under 1,001 names, round after round) or of
    addresses: at most MAX_KEYS kinds are remembered and logged; past them, new kinds go to
    debug until kinds whose period has run out are forgotten."""
    caplog.set_level(logging.DEBUG, logger="thing")
    warn_once = LogOnce()
    for _ in range(3):
        for name in range(LogOnce.MAX_KEYS + 1):
            warn_once(f"failed:{name}", WARNING, "catch of %d failed", name)
            assert len(warn_once._logged_at) <= LogOnce.MAX_KEYS
    assert len(_logged(caplog, logging.WARNING)) == LogOnce.MAX_KEYS
    assert _logged(caplog, logging.DEBUG) == [f"catch of {LogOnce.MAX_KEYS} failed"] * 3
    caplog.clear()
    now = _clock(monkeypatch)
    warn_rarely = LogOnce(per=60)
    for peer in range(LogOnce.MAX_KEYS + 1):
        warn_rarely(("10.0.0.1", peer), WARNING, "peer %d", peer)
    now[0] += 61  # the first thousand's period has run out: a new kind is logged again
    warn_rarely(("10.0.0.2", 0), WARNING, "another peer")
    assert _logged(caplog, logging.WARNING)[-1] == "another peer"
    assert len(warn_rarely._logged_at) == 1
