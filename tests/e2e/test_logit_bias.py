"""logit_bias over the wire: the openai SDK (/v1/completions) and the gRPC stub against a
server of a random-weight Hugging Face directory, each answer equal to transformers'
greedy tokens with the same bias as a logits processor (+100 on one token: every token
is it; -100 on the unbiased answer's tokens: none comes back). Bad biases get 400 /
INVALID_ARGUMENT naming logit_bias. Chat takes it too, on the session's disaggregated
random:tiny servers (prefill and generate on different devices: the bias travels with
the prefix)."""

import grpc
import openai
import pytest

from engines import EngineConfig
from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc
from tests.e2e.conftest import TINY_MODEL, interleaved_servers
from tests.parity.hf_models import hf_greedy, make_hf_model

PROMPT = [1, 40, 9, 88, 17, 3]
STEPS = 8
UP = 77


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(servers, torch model) over a random llama directory (vocabulary 128)."""
    d = str(tmp_path_factory.mktemp("bias_model"))
    model = make_hf_model("llama", d, seed=3)
    config = EngineConfig(max_concurrent_decodes=4, max_prefill_length=16, max_seq_len=48)
    for s in interleaved_servers(d, "m", config):
        yield s, model


@pytest.fixture(scope="module")
def biases(served):
    _, model = served
    plain = hf_greedy(model, PROMPT, STEPS)
    return [{UP: 100.0}, {t: -100.0 for t in plain}]


def _http(served, bias, **kw):
    servers, _ = served
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{servers.http_port}/v1", api_key="unused", max_retries=0)
    return client.completions.create(
        model="m", prompt=PROMPT, max_tokens=STEPS, temperature=0, logprobs=0,
        logit_bias={str(t): v for t, v in bias.items()},
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, **kw)


def test_http_logit_bias_equals_transformers(served, biases):
    _, model = served
    for bias in biases:
        got = [int(t.split(":")[1]) for t in _http(served, bias).choices[0].logprobs.tokens]
        assert got == hf_greedy(model, PROMPT, STEPS, logit_bias=bias)
        if bias.get(UP) == 100.0:
            assert got == [UP] * STEPS
        else:
            assert not set(got) & set(bias)


def test_grpc_logit_bias_equals_transformers(served, biases):
    servers, model = served
    with grpc.insecure_channel(f"127.0.0.1:{servers.grpc_port}") as ch:
        stub = pb_grpc.OrchestratorStub(ch)
        for bias in biases:
            req = pb.DecodeRequest(max_tokens=STEPS, has_bos=True, ignore_eos=True,
                                   token_content=pb.DecodeRequest.TokenContent(
                                       token_ids=PROMPT), logit_bias=bias)
            got = [t for m in stub.Decode(req, timeout=120)
                   for t in m.stream_content.samples[0].token_ids]
            assert got == hf_greedy(model, PROMPT, STEPS, logit_bias=bias)


@pytest.mark.parametrize("bias, says", [
    ({"128": 1}, "not a token id"), ({"-1": 1}, "not a token id"), ({"x": 1}, "not a token id"),
    ({"5": 101}, "[-100, 100]"), ({"5": "up"}, "must be a number"),
    ({str(i): 1 for i in range(301)}, "at most 300"),
])
def test_http_bad_logit_bias_is_400_naming_it(served, bias, says):
    with pytest.raises(openai.BadRequestError) as e:
        _bad(served, bias)
    assert "logit_bias" in str(e.value) and says in str(e.value)


def _bad(served, bias):
    servers, _ = served
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{servers.http_port}/v1", api_key="unused", max_retries=0)
    return client.completions.create(model="m", prompt=PROMPT, max_tokens=2, logit_bias=bias)


def test_grpc_bad_logit_bias_is_invalid_argument(served):
    servers, _ = served
    with grpc.insecure_channel(f"127.0.0.1:{servers.grpc_port}") as ch:
        req = pb.DecodeRequest(max_tokens=2, token_content=pb.DecodeRequest.TokenContent(
            token_ids=PROMPT), logit_bias={500: 1.0})
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.OrchestratorStub(ch).Decode(req, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "logit_bias" in e.value.details()


def test_chat_logit_bias_on_disaggregated_servers(tiny_servers, tiny_orch):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{tiny_servers.http_port}/v1",
                           api_key="unused", max_retries=0)
    kw = dict(model=TINY_MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
              temperature=0, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(**kw).choices[0].message.content
    tok = tiny_orch.tokenizer
    up = tok.encode("x", add_bos=False)[-1]
    forced = client.chat.completions.create(logit_bias={str(up): 100}, **kw)
    assert forced.choices[0].message.content == tok.decode([up] * 6) != plain
    assert forced.usage.completion_tokens == 6
