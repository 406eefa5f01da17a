"""One fault scenario on a running cluster: N concurrent greedy streaming completions (the
official `openai` client), a fault (a process killed with SIGKILL, or frozen with SIGSTOP and
thawed with SIGCONT later) once every stream has produced tokens, then every stream read to its end. Used by tests/faults/ and benchmarks/bench_faults.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import ray

from services.settings import BALANCER_NAME


@dataclass
class Outcome:
    scenario: str
    tokens: list[list[int]]  # per request, what its stream delivered
    arrivals: list[list[float]]  # per request, the wall-clock time each chunk with tokens arrived
    finish_reasons: list[str | None]
    errors: list[str | None]  # per request: the error that ended it, None if it completed
    killed_at: float  # wall clock of the fault
    seconds: float  # the whole run
    fault_result: Any = None  # what the fault returned (the killed pid)

    @property
    def lost(self) -> int:
        return sum(e is not None for e in self.errors)

    def stall_s(self) -> float:
        """The longest a stream that was running at the fault waited for a token after it (between
        two tokens, the later one after the fault): how long serving paused, as a client sees it."""
        waits = []
        for times in self.arrivals:
            if not times or times[0] > self.killed_at:
                continue
            waits += [b - a for a, b in zip(times, times[1:], strict=False) if b > self.killed_at]
        return max(waits, default=0.0)


def prompts(n: int, length: int = 12) -> list[list[int]]:
    """n distinct token-id prompts."""
    return [[0] + [4 + (17 * i + 7 * j) % 300 for j in range(length - 1)] for i in range(n)]


def local_tokens(model_dir, prompts_: list[list[int]], max_tokens: int) -> list[list[int]]:
    """LocalEngine's greedy tokens for `prompts_` (ignoring EOS): what every faulted run must give."""
    from services.engine.engine import EngineConfig, LocalEngine
    from services.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in LocalEngine(EngineConfig(model=str(model_dir))).generate(prompts_, params)]


def sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def kill(pid_of: Callable[[], int]) -> Callable[[], int]:
    """A fault: SIGKILL the process `pid_of()` names; returns its pid."""

    def fault() -> int:
        pid = pid_of()
        sigkill(pid)
        return pid

    return fault


def freeze(pid_of: Callable[[], int], seconds: float) -> Callable[[], int]:
    """A fault: SIGSTOP the process `pid_of()` names and SIGCONT it `seconds` later (from a timer
    thread, whatever the run is doing; nothing if it is gone by then); returns its pid."""

    def fault() -> int:
        pid = pid_of()
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(seconds, thaw, (pid,)).start()
        return pid

    return fault


def thaw(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # killed while frozen
        os.kill(pid, signal.SIGCONT)


def gone(pid: int, wait_s: float = 0.0) -> bool:
    """Process `pid` is gone (or a zombie), waiting (polling, bounded) up to `wait_s` for it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def actor_pid(name: str, namespace: str) -> int:
    return ray.get(ray.get_actor(name, namespace=namespace).pid.remote(), timeout=30)


def expert_worker_pid(namespace: str, index: int = 0) -> int:
    """The pid of the index-th expert worker of the current placement."""
    status = ray.get(ray.get_actor(BALANCER_NAME, namespace=namespace).status.remote(), timeout=30)
    wid = [w["id"] for w in status["workers"] if w["state"] == "serving"][index]
    return actor_pid(f"moe-{wid}", namespace)


async def _stream(
    client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int, got: list[int], times: list[float]
) -> str | None:
    stream = await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    reason = None
    async for chunk in stream:
        choice = chunk.choices[0]
        new = (choice.model_extra or {}).get("token_ids") or []
        if new:
            got += new
            times.append(time.time())
        reason = choice.finish_reason or reason
    return reason


def run(
    url: str,
    scenario: str,
    fault: Callable[[], Any] | None,
    requests: int = 16,
    max_tokens: int = 96,
    kill_after_tokens: int = 8,
    timeout_s: float = 180.0,
) -> Outcome:
    """Start `requests` streams; once each has `kill_after_tokens` tokens, run `fault()` (None:
    no fault); read every stream to its end."""
    batch = prompts(requests)
    tokens: list[list[int]] = [[] for _ in batch]
    arrivals: list[list[float]] = [[] for _ in batch]

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout_s)
        tasks = [
            asyncio.create_task(_stream(client, p, max_tokens, t, a))
            for p, t, a in zip(batch, tokens, arrivals, strict=True)
        ]
        killed_at, result = time.time(), None
        if fault is not None:
            deadline = time.monotonic() + timeout_s
            while min(len(t) for t in tokens) < kill_after_tokens and not all(t.done() for t in tasks):
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.01)
            killed_at = time.time()
            result = await asyncio.to_thread(fault)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        return results, killed_at, result

    t0 = time.monotonic()
    results, killed_at, result = asyncio.run(main())
    errors = [f"{type(r).__name__}: {r}" if isinstance(r, BaseException) else None for r in results]
    reasons = [None if isinstance(r, BaseException) else r for r in results]
    return Outcome(scenario, tokens, arrivals, reasons, errors, killed_at, time.monotonic() - t0, result)


@contextlib.contextmanager
def busy(processes: int):
    """`processes` CPU-bound processes (a loaded machine, as a heavy build beside the cluster)
    while the block runs; killed on exit."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for b in burners:
            b.kill()
            b.wait()


def wait_healed(namespace: str, expert_workers: int, timeout_s: float = 120.0) -> dict:
    """Wait until the balancer answers with `expert_workers` serving workers and every attention
    worker is ready; the balancer's status."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            status = ray.get(ray.get_actor(BALANCER_NAME, namespace=namespace).status.remote(), timeout=10)
            serving = [w for w in status["workers"] if w["state"] == "serving"]
            attention = [ray.get_actor(n, namespace=namespace) for n in status["attention_workers"]]
            ray.get([a.ready.remote() for a in attention], timeout=10)
            if len(serving) == expert_workers == len(status["workers"]):
                return status
            last = status
        except Exception as e:  # restarting
            last = repr(e)
        time.sleep(0.25)
    raise TimeoutError(f"the cluster did not heal in {timeout_s}s: {last}")
