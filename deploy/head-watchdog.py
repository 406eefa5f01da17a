"""Usage: head-watchdog.py STATE_DIR HOST GCS_PORT  (started by deploy/start-head.sh)

Redis and the app live as long as this machine's Ray head: once its GCS stops answering three
times in a row (`ray stop`, `ray down`), stop Redis and the app (their pid files in STATE_DIR, as
last read; SIGTERM, SIGKILL after 20 s). If the GCS comes back within a minute (`ray up` again:
`ray stop; ray start`, then start-head.sh starts Redis and the app anew), watch again; else exit.
A GCS not answering within a minute of the start is never watched (nothing is stopped).
Standard library only: it runs on whatever python3 the head has.
"""

import contextlib
import os
import signal
import socket
import sys
import time

state, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
OURS = {"redis.pid": b"redis-server", "app.pid": b"moe-cluster"}  # pid file -> its command line has


def pid(name: str) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(open(os.path.join(state, name)).read())
    return None


def ours(p: int, name: str) -> bool:
    """`p` is alive and still the process of pid file `name` (not a reused pid)."""
    try:
        with open(f"/proc/{p}/cmdline", "rb") as f:
            return OURS[name] in f.read()
    except OSError:
        return False


def gcs_answers() -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


def stop(known: dict[str, int]) -> None:
    mine = {name: p for name, p in known.items() if ours(p, name)}
    for p in mine.values():
        os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + 20  # (the app's own stop talks to a Ray that is gone: bounded)
    while any(ours(p, name) for name, p in mine.items()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for name, p in mine.items():
        if ours(p, name):
            os.kill(p, signal.SIGKILL)


def gcs_within(seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not gcs_answers():
        if time.monotonic() > deadline:
            return False
        time.sleep(2)
    return True


while gcs_within(60):  # (a GCS never seen, or gone for good: nothing to watch)
    misses, known = 0, {}
    while misses < 3:
        known.update({name: p for name in OURS if (p := pid(name)) is not None})
        time.sleep(2)
        misses = 0 if gcs_answers() else misses + 1
    stop(known)
