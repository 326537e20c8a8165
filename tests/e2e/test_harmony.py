"""gpt-oss's harmony format through the openai SDK, against openai-harmony itself.

A random-weight Llama with gpt-oss's vocabulary: its tokenizer.json is built here from
openai-harmony's own o200k vocabulary file (every token by its rank, the harmony special
tokens at their ids), so token ids mean what they mean to openai-harmony. A Lark grammar
(structured_outputs) with the special tokens in it makes the model write a harmony
answer; the server (--tool-call-parser openai, --reasoning-parser openai_gptoss) renders
prompts with openai-harmony and reads the answer's tokens with its StreamableParser. What
the SDK returns must equal openai-harmony's own parse of the tokens generated.

openai-harmony needs o200k_base.tiktoken; with no network it must be in the directory
TIKTOKEN_ENCODINGS_BASE names. Where that is unset, these tests make the file once with
scripts/harmony_vocab.sh (from the npm registry) in ~/.cache/jetserve/harmony-vocab; where
that cannot run (no npm), they skip.
"""

import base64
import json
import os
import subprocess

import openai
import pytest

from tests.e2e.conftest import local_config, random_llama_orch

MODEL = "gpt-oss-tiny"
VOCAB = 201088  # o200k_harmony: 199998 ranks, then the special and reserved tokens
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "days": {"type": "integer"}}}}}
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris for 3 days?"}]
ANALYSIS = "The user wants the weather."
CALL_ARGS = '{"city": "Paris", "days": 3}'
FINAL = "It is sunny."


def _grammar_text(s: str) -> str:
    return json.dumps(s)


# What the model is made to write (a Lark grammar: special tokens as <|name|>).
CALL = ("start: <|channel|> " + _grammar_text("analysis") + " <|message|> "
        + _grammar_text(ANALYSIS) + " <|end|> <|start|> "
        + _grammar_text("assistant to=functions.get_weather") + " <|channel|> "
        + _grammar_text("commentary ") + " <|constrain|> " + _grammar_text("json")
        + " <|message|> " + _grammar_text(CALL_ARGS) + " <|call|>")
ANSWER = ("start: <|channel|> " + _grammar_text("analysis") + " <|message|> "
          + _grammar_text(ANALYSIS) + " <|end|> <|start|> " + _grammar_text("assistant")
          + " <|channel|> " + _grammar_text("final") + " <|message|> "
          + _grammar_text(FINAL) + " <|return|>")


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jetserve", "harmony-vocab")


def _vocabulary_file() -> None:
    """TIKTOKEN_ENCODINGS_BASE, made with scripts/harmony_vocab.sh where it is unset."""
    if "TIKTOKEN_ENCODINGS_BASE" in os.environ:
        return
    if not os.path.exists(os.path.join(VOCAB_DIR, "o200k_base.tiktoken")):
        made = subprocess.run(["bash", os.path.join(ROOT, "scripts", "harmony_vocab.sh"),
                               VOCAB_DIR], capture_output=True, text=True, timeout=300)
        if made.returncode:
            pytest.skip(f"scripts/harmony_vocab.sh failed: {made.stderr[-500:]}")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = VOCAB_DIR


def _encoding():
    _vocabulary_file()
    try:
        from jetserve.server.harmony import load_encoding

        return load_encoding()
    except RuntimeError as e:
        pytest.skip(str(e))


def _byte_chars() -> dict[int, str]:
    from jetserve.tokenizer import _byte_level_chars

    return {b: c for c, b in _byte_level_chars().items()}


def write_gpt_oss_tokenizer(d, enc) -> None:
    """tokenizer.json with o200k's tokens at their ranks (byte-level, no merges: text is
    only ever encoded here byte by byte) and the harmony specials at their ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    base = os.environ["TIKTOKEN_ENCODINGS_BASE"]
    chars = _byte_chars()
    vocab = {}
    with open(os.path.join(base, "o200k_base.tiktoken")) as f:
        for line in f:
            tok, rank = line.split()
            vocab["".join(chars[b] for b in base64.b64decode(tok))] = int(rank)
    specials = {}
    for i in range(max(vocab.values()) + 1, VOCAB):
        try:
            specials[i] = enc.decode([i])
        except Exception:  # noqa: BLE001 - an id harmony leaves unnamed
            specials[i] = f"<|reserved_{i}|>"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(specials[i], special=True, normalized=False)
                            for i in sorted(specials)])
    assert all(tok.token_to_id(s) == i for i, s in specials.items())
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|startoftext|>", "eos_token": "<|return|>"}))
    stops = [tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))


@pytest.fixture(scope="module")
def harmony_client(tmp_path_factory):
    enc = _encoding()
    from jetserve.server.runner import BackgroundServers

    d = tmp_path_factory.mktemp("gpt_oss_tiny")
    write_gpt_oss_tokenizer(d, enc)
    orch = random_llama_orch(d, VOCAB, 1024, bos_token_id=199998, eos_token_id=200002)
    try:
        with BackgroundServers(orch, local_config(model_name=MODEL, grpc_port=None,
                                                  tool_call_parser="openai",
                                                  reasoning_parser="openai_gptoss")) as s:
            yield enc, openai.OpenAI(base_url=f"http://127.0.0.1:{s.http_port}/v1",
                                     api_key="unused", max_retries=0, timeout=300)
    finally:
        orch.stop(drain=False, timeout=30)


def _ask(client, grammar: str, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER], temperature=0.0, max_tokens=200,
        logprobs=True, extra_body={"structured_outputs": {"grammar": grammar},
                                   "return_tokens_as_token_ids": True,
                                   **kw.pop("extra_body", {})}, **kw)


def _harmony_parse(enc, choice) -> list[dict]:
    """openai-harmony's own parse of the tokens the choice generated."""
    from openai_harmony import Role

    ids = [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content]
    return [m.to_dict() for m in enc.parse_messages_from_completion_tokens(ids,
                                                                           Role.ASSISTANT)]


def _expected(messages: list[dict]) -> tuple[str | None, str | None, list]:
    """reasoning_content, content and calls as the harmony messages hold them."""
    text = {ch: "".join(c["text"] for m in messages if m.get("channel") == ch
                        and not m.get("recipient") for c in m["content"])
            for ch in ("analysis", "final")}
    calls = [(m["recipient"].removeprefix("functions."), m["content"][0]["text"])
             for m in messages if (m.get("recipient") or "").startswith("functions.")]
    return text["analysis"] or None, text["final"] or None, calls


@pytest.mark.parametrize("grammar", [CALL, ANSWER], ids=["call", "answer"])
def test_answers_equal_openai_harmonys_own_parse(harmony_client, grammar):
    enc, client = harmony_client
    whole = _ask(client, grammar).choices[0]
    reasoning, content, calls = _expected(_harmony_parse(enc, whole))
    assert reasoning == ANALYSIS and (content, calls) in ((FINAL, []),
                                                          (None, [("get_weather", CALL_ARGS)]))
    assert whole.message.reasoning_content == reasoning
    assert whole.message.content == content
    assert [(c.function.name, c.function.arguments)
            for c in whole.message.tool_calls or ()] == calls
    assert whole.finish_reason == ("tool_calls" if calls else "stop")

    chunks = [c for c in _ask(client, grammar, stream=True) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert ("".join(d.content or "" for d in deltas) or None) == content
    entries = [e for d in deltas for e in d.tool_calls or ()]
    assert [(e.function.name, "".join(x.function.arguments for x in entries))
            for e in entries[:1]] == calls
    if calls:
        assert len(entries) > 2  # the arguments as they are written
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


def test_the_prompt_is_openai_harmonys_rendering(harmony_client):
    from openai_harmony import (
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    enc, client = harmony_client
    fn = WEATHER["function"]
    conv = Conversation.from_messages([
        Message.from_role_and_content(
            Role.SYSTEM, SystemContent.new().with_reasoning_effort(ReasoningEffort.HIGH)),
        Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new()
                                      .with_instructions("Be brief.")
                                      .with_function_tools([ToolDescription.new(
                                          fn["name"], fn["description"],
                                          parameters=fn["parameters"])])),
        Message.from_role_and_content(Role.USER, MESSAGES[1]["content"])])
    want = enc.render_conversation_for_completion(conv, Role.ASSISTANT)
    r = _ask(client, ANSWER, extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}})
    assert r.usage.prompt_tokens == len(want)
    r = client.responses.create(model=MODEL, instructions="Be brief.",
                                input=MESSAGES[1]["content"],
                                tools=[{"type": "function", **fn}], reasoning={"effort": "high"},
                                temperature=0.0, extra_body={
                                    "structured_outputs": {"grammar": CALL}})
    assert r.usage.input_tokens == len(want)
    assert [i.type for i in r.output] == ["reasoning", "function_call"]
    assert (r.output[1].name, r.output[1].arguments) == ("get_weather", CALL_ARGS)
