"""Which training job a process belongs to: its run, named once per job and inherited.

A run is named by, in order: ``THING_RUN`` (the user's name for it), torchrun's
``TORCHELASTIC_RUN_ID`` (shared by the ranks of one launch; on one node, each
restart of its workers a run of its own), or
``THING_RUN_ID``, which a job sets in its environment when it names a new run
(and a rank of a torchrun launch with the default rendezvous id "none" when it
names its launch after its master's address and its agent, the ranks' parent):
at ``import thing`` in a script, so that the processes it spawns (``mp.spawn``
ranks, spawned DataLoader workers, ``subprocess``) join its run. A forked
child (a DataLoader worker) shares its parent's run in any case.

A REPL or notebook names a run only when it first catches, and never in its
environment, and neither do thing's own commands (``thing serve``, ``record``,
``demo``): jobs started from them are runs of their own. So two jobs started
separately, from one shell or one notebook, are two runs.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional

INHERITED = "THING_RUN_ID"
AGENT_RUN = "torchrun-"  # begins the name of a launch with the default rendezvous id
MAX_RUN_NAME = 200

_run: Optional[str] = None
_exported = False  # whether this process put _run in its environment


def current_run() -> str:
    """This process's run: the one it was given, or a new one."""
    global _run
    if _run is None:
        _run = _named_run() or f"{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}"
    return _run


def name_this_job() -> None:
    """At ``import thing``: a script names its run now, for the processes it will spawn."""
    global _exported
    # A forked child (a notebook's DataLoader worker too) shares its parent's run.
    os.register_at_fork(before=current_run)
    named = _named_run()
    # A name from torchrun's agent must be passed on: what a rank spawns has the rank
    # for its parent. Any other name its children find where this process did.
    if _interactive() or (named is not None and not named.startswith(AGENT_RUN)):
        return
    os.environ[INHERITED] = current_run()
    _exported = True


def forget_this_job() -> None:
    """A thing command is no job: what it starts names runs of its own."""
    global _run, _exported
    if _exported and os.environ.get(INHERITED) == _run:
        del os.environ[INHERITED]
    _run, _exported = None, False


def _interactive() -> bool:
    return (hasattr(sys, "ps1") or bool(sys.flags.interactive)
            or "IPython" in sys.modules or "ipykernel" in sys.modules)


def _named_run() -> Optional[str]:
    for name in (os.environ.get("THING_RUN"), _torchrun_launch(), os.environ.get(INHERITED)):
        if name:
            return name[:MAX_RUN_NAME]
    return None


def _torchrun_launch() -> Optional[str]:
    """The launch torchrun started this rank in: its rendezvous id, or, when that is the
    default "none", its master's address and the agent (the parent) on this node."""
    launch = os.environ.get("TORCHELASTIC_RUN_ID")
    # Ranks torchrun started again (--max-restarts) after a failure count their steps from
    # the start again: a run of their own, not a continuation of the failed attempt's. Each
    # node's agent counts only its own failures, so across nodes (one launch id) the count
    # would split one attempt's ranks: there they stay one run, as the README says.
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    one_node = os.environ.get("GROUP_WORLD_SIZE", "1") == "1" or launch == "none"
    attempt = f"-restart{restart}" if one_node and restart.isdigit() and int(restart) else ""
    if launch and launch != "none":
        return f"{launch[:MAX_RUN_NAME - len(attempt)]}{attempt}"
    master = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if launch == "none" and all(master):
        launched = f"{AGENT_RUN}{master[0]}:{master[1]}-"
        # In a process a rank spawned, the rank's name (its parent is no agent).
        inherited = os.environ.get(INHERITED, "")
        return inherited if inherited.startswith(launched) else (
            f"{launched}{_torchrun_agent()}{attempt}")
    return None


def _torchrun_agent() -> str:
    """This node's torchrun agent, alike in each of its ranks: the folder it made for the
    launch's logs, where each rank's error file is, else its pid (the rank's parent, unless
    a wrapper script stands between them: nsys, numactl, a shell setting the environment)."""
    # <log dir>/<run id>_<random>/attempt_<n>/<local rank>/error.json
    parts = os.environ.get("TORCHELASTIC_ERROR_FILE", "").split(os.sep)
    if len(parts) >= 5 and parts[-3].startswith("attempt_") and parts[-4]:
        return parts[-4]
    return str(os.getppid())
