"""Usage: head-watchdog.py STATE_DIR HOST GCS_PORT  (started by deploy/start-head.sh)

Redis and the app live as long as this machine's Ray head: once its GCS stops answering three
times in a row (`ray stop`, `ray down`), stop Redis and the app (SIGTERM, SIGKILL after 20 s;
their pid files in STATE_DIR). Standard library only: it runs on whatever python3 the head has.
"""

import contextlib
import os
import signal
import socket
import sys
import time

state, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])


def pid(name: str) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(open(os.path.join(state, name)).read())
    return None


def alive(p: int) -> bool:
    try:
        os.kill(p, 0)
        return True
    except OSError:
        return False


misses, known = 0, {}
while misses < 3:
    known.update({name: p for name in ("redis.pid", "app.pid") if (p := pid(name)) is not None})
    time.sleep(2)
    try:
        socket.create_connection((host, port), timeout=2).close()
        misses = 0
    except OSError:
        misses += 1
pids = [p for p in known.values() if alive(p)]  # (as last read: STATE_DIR may be gone by now)
for p in pids:
    os.kill(p, signal.SIGTERM)
deadline = time.monotonic() + 20  # (the app's own stop talks to a Ray that is gone: bounded)
while any(alive(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.5)
for p in pids:
    if alive(p):
        os.kill(p, signal.SIGKILL)
