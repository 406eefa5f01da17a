"""`ray up` for real, as a newcomer runs it: deploy/ray-up-this-machine.sh brings
deploy/ray-up-onprem.yaml up on this machine over SSH to 127.0.0.1 (Ray's on-prem provider, the
repository synced by rsync, start-head.sh's Redis and app), gets a completion from the API, scales
the expert pool and reads the status through `ray exec`, runs `ray down`, and then finds nothing
of the cluster left running. Skipped where it cannot run: not root, sshd or rsync not installed
(the test installs nothing: .ci/run installs them before `make test`), or a Ray node already on
this machine (the script's `ray up` runs `ray stop`)."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
ROOT = Path(__file__).parent.parent


def _port_busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _why_not() -> str | None:
    import ray

    if os.geteuid() != 0:
        return "needs root (sshd on 127.0.0.1, the key in ~/.ssh)"
    missing = _missing()
    if missing:
        return f"needs {' and '.join(missing)} installed (.ci/run installs them; this test installs nothing)"
    if ray.is_initialized() or subprocess.run(["pgrep", "-x", "raylet"], capture_output=True).returncode == 0:
        return "a Ray node runs on this machine"
    busy = [p for p in (6379, 6380, 8000) if _port_busy(p)]
    if busy:
        return f"ports {busy} are in use"
    return None


def _missing() -> list[str]:
    """What the script needs and this machine lacks, by Debian package name."""
    present = {
        "openssh-server": os.access("/usr/sbin/sshd", os.X_OK),
        "rsync": shutil.which("rsync") is not None,
    }
    return [pkg for pkg, ok in present.items() if not ok]


def test_ray_up_onprem_on_this_machine(tmp_path):
    why = _why_not()
    if why:
        pytest.skip(why)
    had_state = Path("~/.moe-cluster").expanduser().exists()
    env = dict(os.environ, MOE_RAY_UP_VENV=sys.prefix)  # (this venv holds the project already)
    script = subprocess.Popen(["sh", str(ROOT / "deploy/ray-up-this-machine.sh"), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        out, _ = script.communicate(timeout=900)
    except subprocess.TimeoutExpired:  # SIGTERM: its cleanup (ray down, the key, sshd) still runs
        script.terminate()
        out, _ = script.communicate(timeout=180)
    log = (tmp_path / "log.txt").read_text()
    assert script.returncode == 0, f"{out[-3000:]}\n{log[-4000:]}"
    assert re.search(r"^ray up done in \d+ s$", log, re.M)
    answer = json.loads(next(line for line in log.splitlines() if line.startswith('{"id":"cmpl-')))
    assert answer["model"] == "tiny" and answer["usage"]["prompt_tokens"] == 4
    status = (tmp_path / "status.txt").read_text()
    assert re.search(r"^expert-2\s+serving", status, re.M)  # scale-experts 3 through ray exec
    assert "all done: nothing left running" in log  # Ray, the app and Redis gone after ray down
    assert Path("~/.moe-cluster").expanduser().exists() == had_state  # (put back as found)
