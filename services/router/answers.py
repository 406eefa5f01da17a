"""What goes into an answer besides the generated text, and where it is worked out (issue #52):
prompt logprobs computed once per prompt and carried by every choice of it, and the templating and
tokenizing of large inputs off the event loop. (The budget on an answer's logprob entries is in
protocol.py, beside the requests whose fields ask for them.)"""

from __future__ import annotations

import asyncio
import dataclasses

from services.engine.outputs import RequestOutput

from .core import Sub
from .protocol import prompt_logprobs_of

# text longer than this (characters, all of a request's prompts or messages together) is templated
# and tokenized on a worker thread: megabytes of it on the event loop would stall every other
# request and stream of the replica for as long as it takes
OFF_LOOP_CHARS = 1 << 14


async def off_loop(chars: int, fn, *args):
    """fn(*args): on a worker thread when it works on more than OFF_LOOP_CHARS characters."""
    return await asyncio.to_thread(fn, *args) if chars > OFF_LOOP_CHARS else fn(*args)


def prompt_logprobs_once(subs: list[Sub], n: int) -> None:
    """Prompt logprobs computed once per prompt: only each prompt's first choice asks the engine
    for them (they bypass the prefix cache, so every choice asking would re-prefill the prompt);
    its siblings carry that choice's (`share_prompt_logprobs`, `PromptLogprobsOrder`)."""
    for sub in subs:
        if sub.index != sub.prompt_index * n:
            sub.params["prompt_logprobs"] = None


def with_prompt_logprobs(out: RequestOutput, plps) -> RequestOutput:
    return out if plps is None else dataclasses.replace(out, prompt_logprobs=plps)


def share_prompt_logprobs(subs: list[Sub], outs: list[list[RequestOutput]], n: int) -> None:
    """Each choice's first output carries its prompt's logprobs (its first sibling's)."""
    for sub, seq in zip(subs, outs, strict=True):
        if seq and sub.index != sub.prompt_index * n:
            seq[0] = with_prompt_logprobs(seq[0], prompt_logprobs_of(outs[sub.prompt_index * n]))


class PromptLogprobsOrder:
    """A stream's outputs in an order where each choice's first output carries its prompt's logprobs:
    a sibling's outputs wait until the prompt's first choice brought them (`share`: False, as they
    come)."""

    def __init__(self, subs: list[Sub], n: int, share: bool):
        self.subs, self.n, self.share = subs, n, share
        self.shared: dict[int, list | None] = {}  # prompt index -> its logprobs (from its first choice)
        self.held: dict[int, list[tuple[int, RequestOutput]]] = {}  # prompt index -> siblings' outputs
        self.began = [False] * len(subs)  # a choice's first output went out

    def __call__(self, index: int, out: RequestOutput) -> list[tuple[int, RequestOutput]]:
        """What to send now that `out` of choice `index` came."""
        if not self.share:
            return [(index, out)]
        p = self.subs[index].prompt_index
        if p not in self.shared:
            if index != p * self.n:
                self.held.setdefault(p, []).append((index, out))
                return []
            self.shared[p] = out.prompt_logprobs
            return [self._release(index, out)] + [self._release(i, o) for i, o in self.held.pop(p, [])]
        return [self._release(index, out)]

    def _release(self, index: int, out: RequestOutput) -> tuple[int, RequestOutput]:
        if not self.began[index]:
            out = with_prompt_logprobs(out, self.shared[self.subs[index].prompt_index])
            self.began[index] = True
        return index, out
