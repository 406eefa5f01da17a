"""Driving a LocalEngine step by step with prompts arriving together or staggered: what the
deterministic-mode tests (tests/test_deterministic*.py) and bench_determinism compare."""

from __future__ import annotations

import torch

from services.engine.engine import LocalEngine
from services.engine.sampling import SamplingParams


def run_staggered(
    engine: LocalEngine, prompts: list[list[int]], params: SamplingParams, stagger: int = 0
) -> list[tuple[list[int], torch.Tensor]]:
    """Each prompt's (output tokens, logits [steps, vocab]), the prompts added together (stagger 0)
    or one every `stagger` steps, so that each lands in batches of a different make-up."""
    ids, logits, tokens = [], {}, {}
    pending = list(prompts)
    while pending or engine.has_unfinished():
        if pending:
            ids.append(engine.add_request(pending.pop(0), params))
            if stagger == 0:
                continue
        for _ in range(max(stagger, 1)):
            result = engine.step()
            for rid, row in zip(
                result.logits_ids, result.logits if result.logits is not None else (), strict=True
            ):
                logits.setdefault(rid, []).append(row.clone())
            for out in result.outputs:
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return [(tokens[r], torch.stack(logits[r])) for r in ids]
