"""`quantloop api`: the resident local Prefect API of a home: where it is, who uses it;
stop it now.
"""

from __future__ import annotations

import datetime as dt
import enum
import json
from typing import Annotated

import typer

from quantloop.cli.common import HomeOption, console, fail, home_of


class Action(enum.StrEnum):
    status = "status"
    stop = "stop"


def api(
    action: Annotated[
        Action,
        typer.Argument(help="status: where it is, its PID, leases, idle time; stop: stop it now"),
    ],
    home: HomeOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print it as JSON.")] = False,
) -> None:
    """The home's resident local Prefect API, which commands that run flows start when no
    API is configured and `quantloop serve` is not running, share, and stop after
    QUANTLOOP_API_IDLE_TIMEOUT_S (900) seconds unused: its status, or stop it now."""
    from quantloop.tasks.runtime.local_api import LocalApiError, status, stop

    try:
        info = status(home_of(home)) if action is Action.status else stop(home_of(home))
    except LocalApiError as exc:
        fail(str(exc), code=1)
    if as_json:
        print(json.dumps(info, indent=1))
        return
    say = lambda line: console.print(line, highlight=False, soft_wrap=True)  # noqa: E731
    if action is Action.stop:
        if not info["stopped"]:
            say(f"no local Prefect API is running for {home_of(home)}")
            return
        users = info["leases"]
        say(f"stopped the local Prefect API at {info['url']} (supervisor {info['pid']}, "
            f"server {info['server_pid']})"
            + (f"; {len(users)} command(s) were using it: "
               + ", ".join(str(u["pid"]) for u in users) if users else ""))  # fmt: skip
        return
    if info.get("configured"):
        say(f"commands here use the configured Prefect API {info['configured']} "
            "(PREFECT_API_URL or the active profile), not this one")  # fmt: skip
    elif info.get("serve"):
        say(f"commands here use quantloop serve's Prefect API {info['serve']}, not this one")
    if not info["running"]:
        state = "stale state, its supervisor is gone" if "url" in info else "not running"
        say(f"local Prefect API of {info['home']}: {state}")
        say(f"  log:       {info['log']}")
        return
    answers = "answers" if info["answers"] else "does NOT answer its health check"
    say(f"local Prefect API of {info['home']}: {info['state']}, {answers}")
    say(f"  API:       {info['url']}")
    say(f"  UI:        {info['ui_url']}")
    say(f"  PID:       {info['pid']} (supervisor), {info['server_pid']} (prefect server start)")
    if info.get("started_at"):
        up = dt.datetime.now(dt.UTC) - dt.datetime.fromisoformat(info["started_at"])
        ready = f", ready in {info['start_s']:.1f} s" if info.get("start_s") else ""
        say(f"  started:   {info['started_at']}{ready}; up {int(up.total_seconds())} s")
    leases = info["leases"]
    say(f"  leases:    {len(leases)}"
        + "".join(f"\n    pid {u['pid']} since {u.get('since', '?')}: {u.get('command', '')}"
                  for u in leases))  # fmt: skip
    timeout = info.get("idle_timeout_s") or 0
    if "idle_s" in info:
        left = max(timeout - info["idle_s"], 0)
        say(f"  idle:      {info['idle_s']:.0f} s of {timeout:g} s; stops in ~{left:.0f} s")
    else:
        say(f"  idle:      in use (stops {timeout:g} s after the last command leaves)")
    say(f"  database:  {info['database']}")
    say(f"  log:       {info['log']}")
