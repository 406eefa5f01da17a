"""Fakes of Ray actor-handle calls for tests that drive the router without Ray."""


class RemoteCall:
    """`handle.method` as the router uses it: `.options(...)` and `.remote(*args)`, here calling
    `fn` directly (it returns what the test wants the call to give: a future, a generator)."""

    def __init__(self, fn):
        self.fn = fn

    def options(self, **_):
        return self

    def remote(self, *args):
        return self.fn(*args)
