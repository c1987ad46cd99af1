"""thing.log.LogOnce: a message of each kind once (or once a period), bounded memory."""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace

import pytest

from thing.log import WARNING, LogOnce


def _logged(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno == level]


def test_each_kind_is_logged_once_and_its_repeats_go_to_debug(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="thing")
    warn_once = LogOnce()
    for attempt in range(3):
        warn_once("lost", WARNING, "lost the server: %s", attempt)
        warn_once("refused", WARNING, "refused: %s", attempt)
    assert _logged(caplog, logging.WARNING) == ["lost the server: 0", "refused: 0"]
    assert _logged(caplog, logging.DEBUG) == ["lost the server: 1", "refused: 1",
                                              "lost the server: 2", "refused: 2"]


def test_a_period_lets_a_kind_be_logged_again_once_it_has_passed(caplog, monkeypatch) -> None:
    caplog.set_level(logging.WARNING, logger="thing")
    now = [1000.0]
    # its own clock only: the module is shadowed by its logger as an attribute of thing
    monkeypatch.setattr(sys.modules["thing.log"], "time", SimpleNamespace(monotonic=lambda: now[0]))
    warn_rarely = LogOnce(per=60)
    for step in range(5):  # every 30 s: logged at 0, 60 and 120 s
        warn_rarely("lost", WARNING, "lost at %d s", 30 * step)
        now[0] += 30
    assert _logged(caplog, logging.WARNING) == ["lost at 0 s", "lost at 60 s", "lost at 120 s"]


def test_its_memory_is_bounded_and_a_new_kind_is_never_kept_quiet(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="thing")
    warn_once = LogOnce()
    for peer in range(3 * LogOnce.MAX_KEYS):  # keys made of addresses, as a server's are
        warn_once(("10.0.0.1", peer), WARNING, "peer %d", peer)
        assert len(warn_once._logged_at) <= LogOnce.MAX_KEYS
    assert len(_logged(caplog, logging.WARNING)) == 3 * LogOnce.MAX_KEYS
