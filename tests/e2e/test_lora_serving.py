"""LoRA adapters served over HTTP and gRPC, on the bundled model (real tokenizer):

- the openai SDK with model="NAME" streams the adapter's greedy text, which equals the
  text of the base weights with the adapter merged (run offline here), and differs from
  the base model's; gRPC lora_adapter_id streams the same;
- /v1/models lists each adapter with `parent` the base model;
- unknown names: HTTP 404 model_not_found, gRPC NOT_FOUND;
- run-time load and unload (vLLM's routes, behind the API key), with one device row for
  two adapters (swapped in least recently used);
- the prefix cache never serves a base prompt's KV to an adapter request;
- metrics by adapter;
- a disaggregated orchestrator (prefill and generate slices, a pool each), with a prompt
  prefilled in chunks too.
"""

import dataclasses

import grpc
import httpx
import jax
import openai
import pytest

from engines import EngineConfig, load_hf_config
from jetserve import orchestrator
from jetserve.lora_adapters import Adapters
from jetserve.model_loading import BUNDLED_DIR, build_engine
from jetserve.offline import generate_many
from jetserve.orchestrator import OrchestratorConfig, Request
from jetserve.server.runner import BackgroundServers
from jetserve.tokenizer import load_tokenizer
from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc
from tests.e2e.conftest import local_config
from tests.engines import lora_files

KEY = "lora-test-key"
MODEL = "bundled"
PROMPT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x = 1\n    y = 2\n"
TOKENS = 12
ENGINE = EngineConfig(max_concurrent_decodes=4, max_prefill_length=64, max_seq_len=128,
                      max_loras=1, max_lora_rank=8)
ADAPTERS = {"alpha": (["q_proj", "v_proj", "down_proj"], 1), "beta": (["o_proj", "up_proj"], 2)}


def prompt_ids(text: str = PROMPT) -> list[int]:
    """The text's token ids, BOS first: sent as ids, so every path sees the same prompt."""
    return load_tokenizer(BUNDLED_DIR).encode(text, add_bos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """name -> (directory, tensors) of two adapters of the bundled model."""
    cfg = load_hf_config(BUNDLED_DIR)
    root = tmp_path_factory.mktemp("lora")
    return {name: lora_files.write_adapter(root / name, cfg, targets, rank=4, alpha=8,
                                           seed=seed, std=0.25)
            for name, (targets, seed) in ADAPTERS.items()}


@pytest.fixture(scope="module")
def merged(adapters):
    """The greedy text of a prompt (token ids) for the base model and each adapter merged
    in, on an engine without LoRA."""
    cfg = load_hf_config(BUNDLED_DIR)
    plain = build_engine(None, devices=jax.devices()[:1],
                         engine_config=EngineConfig(max_concurrent_decodes=1,
                                                    max_prefill_length=64, max_seq_len=128))
    params = plain.load_params()
    weights = {name: lora_files.merged_params(params, tensors, 8 / 4, cfg,
                                              plain.param_shardings)
               for name, (_, tensors) in {None: (None, {}), **adapters}.items()}

    def texts(ids: list[int]) -> dict:
        out = {}
        for name, p in weights.items():
            r = generate_many(plain, p, [ids], max_tokens=TOKENS, ignore_eos=True)[0]
            out[name] = plain.tokenizer.decode(r.token_ids)
        assert out["alpha"] != out[None] and out["beta"] != out[None]
        return out

    return texts


@pytest.fixture(scope="module")
def expected(merged):
    return merged(prompt_ids())


@pytest.fixture(scope="module")
def servers(adapters):
    orch = orchestrator.build(None, interleaved=True, devices=jax.devices()[:1],
                              engine_config=ENGINE,
                              config=OrchestratorConfig(prefix_cache_hbm_bytes=1 << 24))
    Adapters.of(orch).load("alpha", adapters["alpha"][0])  # as --lora-modules alpha=DIR
    orch.start()
    try:
        with BackgroundServers(orch, local_config(model_name=MODEL, api_key=KEY)) as s:
            yield s
    finally:
        orch.stop(drain=False, timeout=30)


@pytest.fixture(scope="module")
def client(servers):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{servers.http_port}/v1", api_key=KEY,
                         max_retries=0, timeout=120)


def _stream(client, model):
    chunks = client.completions.create(model=model, prompt=prompt_ids(), max_tokens=TOKENS,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_models_lists_adapters_with_their_parent(client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL, "alpha"}
    assert cards["alpha"].parent == MODEL  # type: ignore[attr-defined]
    assert client.models.retrieve("alpha").id == "alpha"


def test_sdk_streams_the_merged_adapter_text(client, expected):
    # The base prompt first: its cached blocks must not serve the adapter's request.
    assert _stream(client, MODEL) == expected[None]
    assert _stream(client, "alpha") == expected["alpha"]
    assert _stream(client, MODEL) == expected[None]


def test_grpc_lora_adapter_id_streams_the_adapter(servers, expected):
    with grpc.insecure_channel(f"127.0.0.1:{servers.grpc_port}") as ch:
        stub = pb_grpc.OrchestratorStub(ch)
        req = pb.DecodeRequest(token_content=pb.DecodeRequest.TokenContent(
            token_ids=prompt_ids()), has_bos=True, max_tokens=TOKENS, lora_adapter_id="alpha",
            ignore_eos=True)
        msgs = stub.Decode(req, timeout=120, metadata=(("authorization", f"Bearer {KEY}"),))
        text = "".join(s.text for m in msgs for s in m.stream_content.samples)
    assert text == expected["alpha"]


def test_unknown_adapters_are_not_found(client, servers):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gamma", prompt=PROMPT, max_tokens=2)
    assert e.value.code == "model_not_found" and "gamma" in e.value.message
    with grpc.insecure_channel(f"127.0.0.1:{servers.grpc_port}") as ch:
        stub = pb_grpc.OrchestratorStub(ch)
        req = pb.DecodeRequest(text_content=pb.DecodeRequest.TextContent(text=PROMPT),
                               max_tokens=2, lora_adapter_id="gamma")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Decode(req, timeout=60,
                             metadata=(("authorization", f"Bearer {KEY}"),)))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "lora_adapter_id" in err.value.details()


def test_run_time_load_swap_and_unload(client, servers, adapters, expected):
    base = f"http://127.0.0.1:{servers.http_port}/v1"
    body = {"lora_name": "beta", "lora_path": adapters["beta"][0]}
    r = httpx.post(f"{base}/load_lora_adapter", json=body, timeout=60)
    assert r.status_code == 401  # behind the API key
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{base}/load_lora_adapter", json=body, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    # One device row (max_loras=1): each request swaps the other adapter out.
    assert _stream(client, "beta") == expected["beta"]
    assert _stream(client, "alpha") == expected["alpha"]
    assert _stream(client, "beta") == expected["beta"]
    bad = httpx.post(f"{base}/load_lora_adapter", headers=auth, timeout=60,
                     json={"lora_name": "broken", "lora_path": "/no/such/dir"})
    assert bad.status_code == 400 and "adapter_config.json" in bad.text
    r = httpx.post(f"{base}/unload_lora_adapter", json={"lora_name": "beta"}, headers=auth,
                   timeout=60)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="beta", prompt=PROMPT, max_tokens=2)


def test_metrics_count_requests_by_adapter(client, servers):
    _stream(client, "alpha")
    text = httpx.get(f"http://127.0.0.1:{servers.http_port}/metrics", timeout=60).text
    line = next(x for x in text.splitlines()
                if x.startswith('jetserve_lora_requests_total{adapter="alpha"}'))
    assert float(line.split()[-1]) >= 1


def test_disaggregated_orchestrator_serves_adapters(adapters, expected, merged):
    """Prefill and generate on separate slices, each with its own pool: the prefix moves
    with its adapter's id, and the generate slice finds the adapter's row in its pool;
    a prompt longer than max_prefill_length (prefilled in chunks) too."""
    # A row per adapter in flight: a generate slice's insert cannot wait for one.
    orch = orchestrator.build(None, interleaved=False, devices=jax.devices()[:2],
                              prefill_devices=1, generate_devices=1,
                              engine_config=dataclasses.replace(ENGINE, max_loras=2))
    adapters_of = Adapters.of(orch)
    assert len(adapters_of.engines) == 2
    for name in ("alpha", "beta"):
        adapters_of.load(name, adapters[name][0])
    with orch:
        handles = [orch.submit(Request(prompt_ids=prompt_ids(), max_tokens=TOKENS,
                                       ignore_eos=True, lora_adapter=name))
                   for name in ("beta", None, "alpha")]
        texts = [h.result(timeout=300).text for h in handles]
        long_ids = prompt_ids(PROMPT * 3)
        assert len(long_ids) > ENGINE.max_prefill_length
        handles = [orch.submit(Request(prompt_ids=long_ids, max_tokens=TOKENS,
                                       ignore_eos=True, lora_adapter=name))
                   for name in ("alpha", None, "beta")]
        long_texts = [h.result(timeout=300).text for h in handles]
    assert texts == [expected["beta"], expected[None], expected["alpha"]]
    want = merged(long_ids)
    assert long_texts == [want["alpha"], want[None], want["beta"]]


def test_mixed_steps_serve_two_adapters_and_the_base_in_one_batch(adapters, merged):
    """--scheduling mixed (paged KV, 32-token chunks): "alpha", the base model and "beta"
    at once over the openai SDK, a short prompt and a long one (several chunks) each,
    stream the merged weights' text; nothing compiles after the warm-up (a LoRA server's
    mixed steps with the adapter pool and plain); every adapter row is let go after."""
    import concurrent.futures

    from jetserve import warmup
    from jetserve.orchestrator.config import MIXED

    engine_config = dataclasses.replace(ENGINE, max_loras=2, kv_layout="paged",
                                        page_size=64)
    orch = orchestrator.build(None, devices=jax.devices()[:1], engine_config=engine_config,
                              config=OrchestratorConfig(scheduling=MIXED, prefill_chunk=32))
    adapters_of = Adapters.of(orch)
    for name in ("alpha", "beta"):
        adapters_of.load(name, adapters[name][0])  # as --lora-modules
    long_ids = prompt_ids(PROMPT * 3)
    assert len(long_ids) > 2 * 32
    jobs = [(ids, name) for ids in (prompt_ids(), long_ids) for name in ("alpha", MODEL, "beta")]
    orch.start()
    try:
        warmup.run(orch, progress=False)
        engine = orch.generate_engines[0]
        traced = engine.trace_counts()["mixed"]
        with BackgroundServers(orch, local_config(model_name=MODEL)) as s:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{s.http_port}/v1",
                                   api_key="unused", max_retries=0, timeout=300)

            def complete(job):
                ids, model = job
                chunks = client.completions.create(model=model, prompt=ids,
                                                   max_tokens=TOKENS, temperature=0,
                                                   stream=True,
                                                   extra_body={"ignore_eos": True})
                return "".join(c.choices[0].text for c in chunks if c.choices)

            with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
                texts = list(pool.map(complete, jobs))
        assert engine.trace_counts()["mixed"] == traced
        assert not engine._slot_rows and not any(engine.adapters._pins)
    finally:
        orch.stop(drain=False, timeout=30)
    short, long = merged(prompt_ids()), merged(long_ids)
    assert texts == [short["alpha"], short[None], short["beta"],
                     long["alpha"], long[None], long["beta"]]
