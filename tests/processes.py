"""Process checks that the launcher's and the sessions' tests share: is a pid still running, and
are all of these gone (no orphans)."""

import time
from pathlib import Path


def alive(pid: int) -> bool:
    """True if pid is a running (not zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def assert_gone(pids: list[int], within: float = 3.0) -> None:
    """Every pid has exited within ``within`` seconds (a rank's watchdog polls every 0.5 s)."""
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], "processes left behind"
