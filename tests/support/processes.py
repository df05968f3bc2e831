"""What runs leave behind, as the launcher's, the sessions' and the class tests check it: is a pid
still running, are all of these gone (no orphans), and what is left in a run's temporary folder."""

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
    left = [p for p in pids if alive(p)]
    assert not left, f"processes left behind after {within:g} s: {[_describe(p) for p in left]}"


def _describe(pid: int) -> str:
    """pid and command line, for a failure message."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return str(pid)
    return f"{pid} ({' '.join(a.decode(errors='replace') for a in argv if a)[:120]})"


def left_in_temp(folder: Path) -> list[str]:
    """What a run left in the TMPDIR it was given, but torch's per-user compile cache
    (``torchinductor_<user>``, made when a torch.optim step first imports torch._dynamo, and kept
    across a user's runs as torch means it)."""
    return sorted(p.name for p in Path(folder).iterdir() if not p.name.startswith("torchinductor_"))
