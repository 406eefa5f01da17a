"""Soak: continuous load while SIGKILLs rotate over every kind of process. Six clients (the
official `openai` client with its default retries: 2, on 5xx and connection errors) send greedy
completions without pause; an expert worker, an attention worker, the balancer, a router replica
and Redis are killed in turn, each once the cluster has healed from the one before. Every request
must be answered with LocalEngine's tokens, and the pool must be whole at the end."""

import itertools
import threading
import time

import openai
import pytest
from ray import serve

from services.cluster import APP_NAME
from services.redis_store import EmbeddedRedis
from services.settings import BALANCER_NAME

from ..clusters import tiny_cluster
from . import scenario

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

PROMPTS, MAX_TOKENS, CLIENTS, EXPERT_WORKERS = 6, 32, 6, 3


def test_soak_with_a_kill_of_every_kind(tiny_model):
    prompts = scenario.prompts(PROMPTS)
    expected = scenario.local_tokens(tiny_model, prompts, MAX_TOKENS)
    with tiny_cluster(tiny_model, attention_workers=2, expert_workers=EXPERT_WORKERS, balancer_period_s=0,
                      max_num_seqs=32) as cluster:  # fmt: skip
        ns = cluster.cfg.namespace
        answers, wrong, errors, stop = [0], [], [], threading.Event()

        def client(seed: int) -> None:
            api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", timeout=120)  # (max_retries 2)
            for p in itertools.cycle(range(seed, seed + PROMPTS)):
                if stop.is_set():
                    return
                p %= PROMPTS
                try:
                    reply = api.completions.create(model="tiny", prompt=prompts[p], max_tokens=MAX_TOKENS, temperature=0.0,
                                                   extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
                    answers[0] += 1
                    if reply.choices[0].model_extra["token_ids"] != expected[p]:
                        wrong.append(p)
                except Exception as e:  # noqa: BLE001 (recorded: asserted below)
                    errors.append(repr(e))

        def served_on(n: int, what: str, deadline_s: float = 120.0) -> None:
            target, deadline = answers[0] + n, time.monotonic() + deadline_s
            while answers[0] < target and not errors:
                assert time.monotonic() < deadline, f"after the {what} kill: {answers[0]} of {target} answers"
                time.sleep(0.05)

        def kill_redis() -> int:
            pid = cluster.redis.process.pid
            scenario.sigkill(pid)
            served_on(6, "Redis")  # serving goes on without it ...
            port = int(cluster.redis_url.rsplit(":", 1)[1].split("/")[0])
            cluster.redis = EmbeddedRedis.start(
                port=port, password=cluster.redis.password
            )  # ... and it comes back on its port
            return pid

        kills = [
            ("expert worker", lambda: scenario.sigkill(scenario.expert_worker_pid(ns, 0))),
            ("attention worker", lambda: scenario.sigkill(scenario.actor_pid("moe-attn-1", ns))),
            ("balancer", lambda: scenario.sigkill(scenario.actor_pid(BALANCER_NAME, ns))),
            (
                "router replica",
                lambda: scenario.sigkill(serve.get_app_handle(APP_NAME).pid.remote().result(timeout_s=30)),
            ),
            ("Redis", kill_redis),
        ]
        first = {w["id"] for w in scenario.wait_healed(ns, expert_workers=EXPERT_WORKERS)["workers"]}
        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        log = []
        try:
            served_on(CLIENTS, "start")
            for what, kill in kills:
                t0, before = time.monotonic(), answers[0]
                kill()
                served_on(12, what)
                scenario.wait_healed(ns, expert_workers=EXPERT_WORKERS, timeout_s=180)
                log.append(
                    f"{what}: healed in {time.monotonic() - t0:.1f}s, {answers[0] - before} answers meanwhile"
                )
        finally:
            stop.set()
            for t in threads:
                t.join()
        print("soak:", "; ".join(log), f"; {answers[0]} answers in all")
        assert errors == [] and wrong == [], (errors[:3], wrong[:3])
        status = scenario.wait_healed(ns, expert_workers=EXPERT_WORKERS)  # the pool whole at the end,
        assert {w["id"] for w in status["workers"]} - first  # the killed worker replaced by a new one
