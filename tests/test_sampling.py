"""The sampler's logits processing: penalties, logit bias, min_tokens, min_p (as OpenAI / vLLM
define them), batched with rows that use none of them."""

import pytest
import torch

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParamError, SamplingParams, process_logits, sample

GREEDY = {"temperature": 0.0, "max_tokens": 8}


def _logits():
    return torch.tensor([[2.0, -1.0, 0.5, 0.0, 1.0], [0.1, 0.2, 0.3, 0.4, 0.5]])


def test_penalties_follow_their_definitions():
    history = [([1], [0, 0, 4]), ([], [])]  # row 0: prompt [1], generated 0 twice and 4 once
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0),
        SamplingParams(),
    ]
    logits = _logits()
    out = process_logits(logits, params, history, [set(), set()])
    assert torch.equal(logits, _logits())  # a new tensor: the caller's logits are untouched
    # repetition: tokens 0, 1, 4 seen (prompt or output): positive / 2, negative * 2
    # frequency: - 0.25 x count; presence: - 0.5 where generated
    want0 = torch.tensor([2.0 / 2 - 0.5 - 0.5, -1.0 * 2, 0.5, 0.0, 1.0 / 2 - 0.25 - 0.5])
    torch.testing.assert_close(out[0], want0)
    torch.testing.assert_close(out[1], _logits()[1])  # untouched row
    # no row processes its logits: the very same tensor back, no copy, nothing changed
    plain = _logits()
    assert process_logits(plain, [SamplingParams()] * 2, history, [set(), set()]) is plain
    assert torch.equal(plain, _logits())


def test_logit_bias_and_min_tokens():
    params = [SamplingParams(logit_bias={3: 5.0}, min_tokens=2, **GREEDY), SamplingParams(**GREEDY)]
    tokens, _ = sample(_logits(), params, [torch.Generator()] * 2, [([], [2]), ([], [])], [{3, 0}, set()])
    # row 0: bias would make 3 the argmax, but it is a stop token and min_tokens is not reached: 0 too
    assert tokens == [4, 4]
    tokens, _ = sample(_logits(), params, [torch.Generator()] * 2, [([], [2, 2]), ([], [])], [set(), set()])
    assert tokens[0] == 3  # min_tokens reached (nothing held back any more): the bias wins


def test_min_p_keeps_only_likely_tokens():
    logits = torch.tensor([[5.0, 4.9, 0.0, -3.0]])
    params = [SamplingParams(temperature=1.0, min_p=0.5, seed=1)]
    seen = {sample(logits, params, [torch.Generator().manual_seed(s)])[0][0] for s in range(64)}
    assert seen == {0, 1}


@pytest.mark.parametrize(
    "bad",
    [{"presence_penalty": 3}, {"repetition_penalty": 0}, {"min_p": 1.5}, {"min_tokens": 99, "max_tokens": 8},
     {"logit_bias": {5: 1000.0}}],
)  # fmt: skip
def test_out_of_range_values_are_refused(bad):
    with pytest.raises(SamplingParamError):
        SamplingParams(**bad).validate()


def test_penalties_change_greedy_output_as_specified(tiny_model):
    """A frequency penalty large enough makes greedy decoding stop repeating itself; with
    min_tokens the model cannot stop early on EOS; batched rows do not disturb each other."""
    engine = LocalEngine(EngineConfig(model=str(tiny_model)))
    prompt = [0, 7, 7, 7, 7]
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    penalised = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=2.0,
                               presence_penalty=2.0)  # fmt: skip
    a, b = engine.generate([prompt, prompt], [plain, penalised])
    alone = engine.generate([prompt], plain)[0]
    assert a.token_ids == alone.token_ids  # the penalised neighbour changed nothing
    assert b.token_ids != a.token_ids
    assert max(b.token_ids.count(t) for t in set(b.token_ids)) <= max(
        a.token_ids.count(t) for t in set(a.token_ids)
    )
    banned = SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, logit_bias={t: -100.0 for t in a.token_ids}
    )
    c = engine.generate([prompt], banned)[0]
    assert not set(c.token_ids) & set(a.token_ids)
