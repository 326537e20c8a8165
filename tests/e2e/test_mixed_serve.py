"""`jetserve serve --scheduling mixed` on the bundled model: every step runs the decoding
sequences' tokens and chunks of waiting prompts (16-token chunks here).

Greedy tokens over the openai SDK (streamed and not) and the gRPC stub equal `jetserve
generate`'s (turns, contiguous KV), for prompts shorter and longer than a chunk and for
more requests at once than there are slots; a stream the client drops gives its slot and
pages back; and no step program is traced after the warm-up (JAX_LOG_COMPILES logs each
trace of the mixed step, `traced`, whether its compile then comes from the cache or not).
Structured output (a json_schema response_format, a regex and a choice), sent at once
beside a plain request: valid output, and the tokens `jetserve batch` (turns) gives the
same rows; the token masks' programs were compiled by the warm-up too.
With the prefix cache on (its blocks in the KV pages), prompts sharing a 70-token prefix
stream the same greedy tokens, and /metrics counts the cached tokens they skipped.
Everything again with n-gram speculative decoding (`--speculative ngram:3`: verify rows
beside the chunks), whose greedy tokens are the same.
"""

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import threading
import time

import grpc
import httpx
import openai
import pytest

from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc
from tests.e2e.serve_process import READY, wait_listening
from tests.xla import xla_flags

SERVE = ["--scheduling", "mixed", "--kv-layout", "paged", "--max-seq-len", "128",
         "--max-prefill-length", "32", "--prefill-chunk", "16", "--max-concurrent-decodes",
         "4", "--page-size", "32", "--enable-prefix-caching"]
PAGES = 16  # the default pool: 4 slots x 128 / 32
PROMPTS = [[1, 450, 3996], [1, *range(300, 340)], [1, *range(500, 517)],
           [1, *range(700, 760)], [1, 887, 338, 263, 1243], [1, *range(900, 933)]]
# A 71-token prefix (two whole pages of 32) in three prompts: ended differently, and the
# first again (cached whole but for its last token).
PREFIX = [1, *range(1000, 1070)]
SHARED = [[*PREFIX, 5, 6], [*PREFIX, 40, 41, 42, 43, 44], [*PREFIX, 5, 6]]
MAX_TOKENS = 12
COMPILE = re.compile(r"Finished tracing traced for jit")
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["red", "green", "blue"]
# id -> (a chat or completions request's fields beside the model, its output's check)
STRUCTURED = {
    "json": (dict(messages=[{"role": "user", "content": "Describe a person as JSON."}],
                  response_format={"type": "json_schema", "json_schema": {
                      "name": "person", "strict": True, "schema": SCHEMA}}),
             lambda t: set(json.loads(t)) == {"name", "age"}
             and 0 <= json.loads(t)["age"] <= 120 and len(json.loads(t)["name"]) <= 8),
    "regex": (dict(prompt="Answer: ", structured_outputs={"regex": REGEX}),
              lambda t: re.fullmatch(REGEX, t)),
    "choice": (dict(prompt="Pick a colour: ", guided_choice=CHOICES),
               lambda t: t in CHOICES),
}


@pytest.fixture(scope="module", params=["plain", "ngram"])
def server(request):
    """The server, and again with n-gram speculative decoding (each decode row a verify
    row of 4 tokens, beside the chunks)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_LOG_COMPILES="1",
               XLA_FLAGS=xla_flags(1))
    spec = ["--speculative", "ngram:3"] if request.param == "ngram" else []
    cmd = [sys.executable, "-m", "jetserve", "serve", *SERVE, *spec, "--host", "127.0.0.1",
           "--grpc-port", "0", "--http-port", "0"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: list[str] = []
    ports = wait_listening(proc, 2, lines=lines)
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    yield ports, lines
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def reference():
    """`jetserve generate` (prefill / insert / generate turns, contiguous KV) greedy ids."""
    cmd = [sys.executable, "-m", "jetserve", "generate", "--max-tokens", str(MAX_TOKENS),
           "--ignore-eos", "--json"]
    for p in PROMPTS + SHARED:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr
    return [json.loads(line)["token_ids"] for line in out.stdout.splitlines()]


def _client(ports):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{ports['HTTP']}/v1", api_key="unused",
                         max_retries=0, timeout=300)


def _complete(client, prompt, stream):
    kw = dict(model="bundled_model", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
              logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    if not stream:
        tokens = client.completions.create(**kw).choices[0].logprobs.tokens
    else:
        tokens = [t for chunk in client.completions.create(stream=True, **kw)
                  for c in chunk.choices if c.logprobs for t in c.logprobs.tokens]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _metric(ports, name, labels='engine="0"') -> float:
    text = httpx.get(f"http://127.0.0.1:{ports['HTTP']}/metrics").text
    return float(re.search(rf'{name}{{{labels}}} ([0-9.]+)', text).group(1))


def _pages_back(ports) -> float:
    """Free pages and those only the prefix cache holds (its device tier is the pool)."""
    return (_metric(ports, "jetserve_kv_pages_free")
            + _metric(ports, "jetserve_prefix_cache_blocks", 'engine="0",tier="hbm"'))


@pytest.mark.slow
def test_mixed_serve_streams_generates_tokens_concurrently_and_frees_cancelled_pages(
        server, reference, request):
    ports, lines = server
    client = _client(ports)
    # More requests than slots, streamed and not, at once: chunks of several prompts and
    # decode rows share steps.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda a: _complete(client, *a),
                            [(p, i % 2 == 0) for i, p in enumerate(PROMPTS)]))
    assert got == reference[:len(PROMPTS)]
    with grpc.insecure_channel(f"127.0.0.1:{ports['gRPC']}") as channel:
        msgs = list(pb_grpc.OrchestratorStub(channel).Decode(pb.DecodeRequest(
            max_tokens=MAX_TOKENS, has_bos=True, ignore_eos=True,
            token_content=pb.DecodeRequest.TokenContent(token_ids=PROMPTS[3])), timeout=300))
    assert [t for m in msgs for s in m.stream_content.samples for t in s.token_ids] == reference[3]
    # A stream dropped mid-way: the server cancels it, its slot and pages come back.
    stream = client.completions.create(model="bundled_model", prompt=PROMPTS[1],
                                       max_tokens=80, stream=True,
                                       extra_body={"ignore_eos": True})
    for _, _ in zip(range(3), stream, strict=False):
        pass
    stream.close()
    deadline = time.monotonic() + 60
    while (_pages_back(ports) != PAGES
           or _metric(ports, "jetserve_slots_in_use")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _pages_back(ports) == PAGES
    assert _metric(ports, "jetserve_slots_in_use") == 0
    ready = next(i for i, line in enumerate(lines) if READY in line)
    # Buckets 8, 16, 32 (budget 4 + 16, or 4 x 4 + 16 with verify rows) and the
    # decode-rows step (generate's program) by widths 1, 2, 4 pages, each with a token
    # mask and without; with verify rows, the program that writes a prefix-cache hit's
    # tokens into the history too (MixedRow.context); none compiles later.
    spec = request.node.callspec.params["server"] == "ngram"
    assert len([x for x in lines[:ready] if COMPILE.search(x)]) == 24 + spec
    assert [x for x in lines[ready:] if COMPILE.search(x)] == []


def _structured(client, fields):
    """A greedy structured request's (text, finish reason, token ids) over the SDK."""
    kw = dict(model="bundled_model", max_tokens=40, temperature=0,
              extra_body={"return_tokens_as_token_ids": True,
                          **{k: v for k, v in fields.items() if k in
                             ("structured_outputs", "guided_choice")}})
    if "messages" in fields:
        c = client.chat.completions.create(messages=fields["messages"], logprobs=True,
                                           response_format=fields["response_format"],
                                           **kw).choices[0]
        text, tokens = c.message.content, [t.token for t in c.logprobs.content]
    else:
        c = client.completions.create(prompt=fields["prompt"], logprobs=0, **kw).choices[0]
        text, tokens = c.text, c.logprobs.tokens
    return text, c.finish_reason, [int(t.removeprefix("token_id:")) for t in tokens]


@pytest.mark.slow
def test_structured_output_beside_a_plain_request_matches_the_turns_path(
        server, reference, tmp_path):
    ports, lines = server
    client = _client(ports)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": k, "max_tokens": 40, "temperature": 0, **f}) + "\n"
                           for k, (f, _) in STRUCTURED.items()))
    batch = subprocess.run([sys.executable, "-m", "jetserve", "batch", "--input", str(inp),
                            "--output", str(out), "--no-progress"], capture_output=True,
                           text=True, timeout=900, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert batch.returncode == 0, batch.stderr
    want = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    # All at once, with a plain request (a long prompt: several chunks) in the same steps.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        plain = pool.submit(_complete, client, PROMPTS[3], False)
        got = dict(zip(STRUCTURED, pool.map(lambda f: _structured(client, f[0]),
                                            STRUCTURED.values()), strict=True))
    assert plain.result() == reference[3]
    for k, (_, check) in STRUCTURED.items():
        text, finish, tokens = got[k]
        assert finish == "stop" and check(text), (k, text)
        assert tokens == want[k], k
    ready = next(i for i, line in enumerate(lines) if READY in line)
    assert [x for x in lines[ready:] if COMPILE.search(x)] == []  # masked steps: warm


@pytest.mark.slow
def test_mixed_serve_prefix_cache_hits_give_the_uncached_tokens(server, reference):
    ports, lines = server
    client = _client(ports)
    hits = lambda: _metric(ports, "vllm:prefix_cache_hits_total",  # noqa: E731
                           'model_name="bundled_model"')
    before = hits()
    got = []
    for i, p in enumerate(SHARED):  # one at a time: each finds what the last cached
        got.append(_complete(client, p, stream=i == 1))
    assert got == reference[len(PROMPTS):]
    # The first stored the prefix's two whole pages; the two others linked them: 2 x 64
    # cached tokens they did not run.
    assert hits() - before == 2 * 64
    assert _metric(ports, "jetserve_prefix_cache_hit_rate") > 0
    ready = next(i for i, line in enumerate(lines) if READY in line)
    assert [x for x in lines[ready:] if COMPILE.search(x)] == []
