"""MockEngine follows the arithmetic its docstring promises."""

from engines import MockEngine
from jetserve.offline import generate_many


def test_mock_engine_arithmetic_and_slots():
    eng = MockEngine(max_concurrent_decodes=2, vocab_size=50)
    params = eng.load_params()
    results = generate_many(eng, params, [[3, 4], [40, 5], [1]], max_tokens=5)
    assert [r.token_ids for r in results] == [
        [7, 8, 9, 10, 11],
        [45, 46, 47, 48, 49],
        [1, 2, 3, 4, 5],  # joined after a slot freed
    ]
    assert results[0].logprobs == [-0.75, 0.0, -0.25, -0.5, -0.75]
    assert results[1].token_ids[-1] == 49 and eng.vocab_size == 50


def test_mock_engine_eos_and_wraparound():
    eng = MockEngine(max_concurrent_decodes=1, vocab_size=10, eos_ids=(2,))
    r = generate_many(eng, eng.load_params(), [[8]], max_tokens=10)[0]
    assert r.token_ids == [8, 9, 0, 1, 2] and r.finish_reason == "stop"
