"""OpenAI-compatible requests -> orchestrator Requests, and results -> OpenAI JSON.

Pure functions over validated bodies (jetserve.server.openai_schema) and joined deltas
(jetserve.server.streams.Joined); no I/O, no state.

Conventions kept from OpenAI / vLLM so clients and evaluation harnesses work unchanged:
- string prompts get BOS the way the tokenizer's config says; token-id prompts are used
  verbatim; chat prompts get what the chat template writes;
- a field the request leaves unset takes the model's default (its generation_config.json,
  jetserve.generation_config), else OpenAI's: `temperature` 1.0; `max_tokens` 16 for
  completions and the room left in the sequence for chat;
- `echo` + `logprobs` returns the prompt tokens' log-probs first (the first one is null,
  nothing precedes it); with `max_tokens: 0` that is all it returns (scoring);
- choice index = prompt index x n + sample index.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jetserve import generation_config
from jetserve.request import Request
from jetserve.server import (
    chat_template,
    harmony,
    reasoning,
    tool_calls,
    tool_formats,
    tool_output,
)
from jetserve.server import validation as v
from jetserve.server.logprob_text import Shown, TokenTexts
from jetserve.server.openai_schema import ChatRequest, CompletionRequest, prompt_list
from jetserve.server.streams import Joined
from jetserve.server.structured_fields import constraint_of, refuse_unimplemented


@dataclasses.dataclass
class Prepared:
    """A validated request: prompts, their Requests (prompt-major), and output options."""

    prompts: list[list[int]]
    prompt_texts: list[str | None]  # the prompt as the client wrote it, for echo
    requests: list[Request]  # empty when not `run`
    choices: int
    n: int
    echo: bool
    logprobs: int | None
    stream: bool
    include_usage: bool
    run: bool  # False: max_tokens 0 without scoring, nothing to compute
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: "token_id:N" entries
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: usage on every chunk
    tools: tool_calls.ToolPlan | None = None  # chat: the tools in play, if any
    think: reasoning.ThinkFormat | None = None  # chat: where the thinking is, if split out
    harmony: bool = False  # chat: gpt-oss's harmony format, rendered and read by tokens


# OpenAI's defaults for what a request leaves unset and the model's generation_config
# does not set either (jetserve.generation_config.resolve); max_tokens is per endpoint.
OPENAI_DEFAULTS = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                       frequency_penalty=0.0, presence_penalty=0.0)
COMPLETION_MAX_TOKENS = 16


def _common(limits: v.ModelLimits, r: Any, max_tokens_field: str, prompt_len: int,
            max_tokens: int | None, *, allow_zero: bool,
            default_max_tokens: int | None = None) -> tuple[Any, int, dict]:
    """`default_max_tokens`: max_tokens of a request that sets none and whose model sets
    none (None: the room left in the sequence)."""
    room = limits.max_seq_len - prompt_len
    asked = {f: getattr(r, f) for f in OPENAI_DEFAULTS} | {"max_tokens": max_tokens}
    got = generation_config.resolve(
        asked, limits.generation,
        OPENAI_DEFAULTS | {"max_tokens": room if default_max_tokens is None
                           else default_max_tokens}, room=room)
    max_tokens = got.pop("max_tokens")
    sampling = v.sampling_params(**got, seed=r.seed,
                                 logit_bias=v.logit_bias_pairs(limits, r.logit_bias))
    max_tokens = v.check_max_tokens(limits, max_tokens, prompt_len, max_tokens_field,
                                    allow_zero=allow_zero)
    n = v.check_samples(1 if r.n is None else r.n)
    refuse_unimplemented(r.model_extra)
    extra = dict(stop_strings=v.check_stop(r.stop),
                 stop_token_ids=v.check_stop_token_ids(limits, r.stop_token_ids),
                 ignore_eos=bool(r.ignore_eos), constraint=constraint_of(r))
    return sampling, n, dict(max_tokens=max_tokens, **extra)


def _stream_flags(r: Any) -> tuple[bool, bool]:
    stream = bool(r.stream)
    return stream, bool(stream and r.stream_options and r.stream_options.include_usage)


def _continuous_usage(r: Any) -> bool:
    opts = r.stream_options
    return bool(r.stream and opts and opts.include_usage and opts.continuous_usage_stats)


def check_model(name: str | None, served: str, adapters: Any = None) -> str | None:
    """The LoRA adapter a request's `model` names (None: the base model). On a server
    with adapters (jetserve.lora_adapters.Adapters) another name raises UnknownAdapter
    (404 model_not_found); without, InvalidArgument."""
    if name is None or name == served:
        return None
    if adapters is not None and adapters.enabled:
        adapters.check(name)
        return name
    raise v.InvalidArgument("model", f"model {v.show(name)} is not served here; "
                                     f"this server serves {served!r}")


def prepare_completion(limits: v.ModelLimits, r: CompletionRequest, served: str,
                       client: str = "", adapters: Any = None) -> Prepared:
    adapter = check_model(r.model, served, adapters)
    if r.suffix:
        raise v.InvalidArgument("suffix", "suffix is not supported")
    prompts: list[list[int]] = []
    texts: list[str | None] = []
    items = prompt_list(r.prompt)
    v.check_sub_requests(limits, len(items), v.check_samples(1 if r.n is None else r.n))
    for k, p in enumerate(items):
        field = "prompt" if len(items) == 1 else f"prompt[{k}]"
        if isinstance(p, str):
            ids = v.encode_text(limits, p, field, add_bos=None)
            texts.append(p)
        else:
            ids = v.check_token_ids(limits, p, field)
            texts.append(None)
        v.check_prompt_length(limits, ids, field)
        prompts.append(ids)
    logprobs = None if r.logprobs is None else v.check_logprobs(limits, r.logprobs)
    echo = bool(r.echo)
    scoring = echo and logprobs is not None
    requests, n = [], 1
    run = True
    for ids in prompts:
        sampling, n, kw = _common(limits, r, "max_tokens", len(ids), r.max_tokens,
                                  allow_zero=True, default_max_tokens=COMPLETION_MAX_TOKENS)
        if r.best_of is not None and r.best_of != n:
            raise v.InvalidArgument("best_of", f"best_of must equal n ({n}) here, "
                                               f"got {v.show(r.best_of)}")
        if kw["max_tokens"] == 0 and not scoring:
            run = False  # nothing to generate and nothing to score
            continue
        requests.extend(Request(prompt_ids=tuple(ids), sampling=v.sample_seed(sampling, j),
                                logprobs=logprobs, prompt_logprobs=scoring, client=client,
                                lora_adapter=adapter, **kw)
                        for j in range(n))
    stream, usage = _stream_flags(r)
    if not run:
        requests = []
    return Prepared(prompts=prompts, prompt_texts=texts, requests=requests,
                    choices=len(prompts) * n, n=n, echo=echo, logprobs=logprobs,
                    stream=stream, include_usage=usage, run=run,
                    tokens_as_ids=bool(r.return_tokens_as_token_ids),
                    continuous_usage=_continuous_usage(r))


def prepare_chat(limits: v.ModelLimits, r: ChatRequest, served: str,
                 client: str = "", adapters: Any = None,
                 tool_parser: str = tool_calls.DEFAULT_PARSER,
                 reasoning_parser: str | None = None) -> Prepared:
    """`tool_parser`: the format tool_choice "auto" reads calls in (--tool-call-parser);
    `reasoning_parser`: where the model writes its thinking (--reasoning-parser). Either
    naming gpt-oss's harmony renders the prompt with openai-harmony (jetserve.server.harmony)."""
    adapter = check_model(r.model, served, adapters)
    v.check_sub_requests(limits, 1, v.check_samples(1 if r.n is None else r.n))
    add_gen = True if r.add_generation_prompt is None else r.add_generation_prompt
    plan = tool_calls.plan_tools(r.tools, r.tool_choice, r.parallel_tool_calls, tool_parser)
    extra = chat_template.check_template_kwargs(r.chat_template_kwargs)
    uses_harmony = is_harmony(tool_parser, reasoning_parser)
    if uses_harmony:
        if plan is not None and plan.forced:
            raise v.InvalidArgument("tool_choice", f"tool_choice {v.show(r.tool_choice)} is "
                                    "not supported with gpt-oss's harmony format; use auto")
        ids = harmony.prompt_ids(chat_template.normalize_messages(r.messages),
                                 plan and list(plan.tools), extra)
    else:
        ids = chat_template.chat_prompt_ids(limits, r.messages, add_gen,
                                            tools=plan and plan.tools, extra=extra)
    think = None
    if reasoning_parser in reasoning.PARSERS and reasoning.thinking_on(extra):
        think = reasoning.PARSERS[reasoning_parser]
    v.check_prompt_length(limits, ids, "messages")
    field, max_tokens = "max_tokens", r.max_tokens
    if r.max_completion_tokens is not None:
        field, max_tokens = "max_completion_tokens", r.max_completion_tokens
    sampling, n, kw = _common(limits, r, field, len(ids), max_tokens, allow_zero=False)
    logprobs = None
    if r.logprobs:
        logprobs = v.check_logprobs(limits, r.top_logprobs or 0, "top_logprobs")
    elif r.top_logprobs:
        raise v.InvalidArgument("top_logprobs", "top_logprobs needs logprobs: true")
    kw["constraint"] = tool_calls.output_constraint(plan, kw.get("constraint"))
    requests = [Request(prompt_ids=tuple(ids), sampling=v.sample_seed(sampling, j),
                        logprobs=logprobs, client=client, lora_adapter=adapter, **kw)
                for j in range(n)]
    stream, usage = _stream_flags(r)
    return Prepared(prompts=[ids], prompt_texts=[None], requests=requests, choices=n, n=n,
                    echo=False, logprobs=logprobs, stream=stream, include_usage=usage,
                    run=True, tokens_as_ids=bool(r.return_tokens_as_token_ids),
                    continuous_usage=_continuous_usage(r), tools=plan, think=think,
                    harmony=uses_harmony)


def is_harmony(tool_parser: str, reasoning_parser: str | None) -> bool:
    """The server speaks gpt-oss's harmony (--tool-call-parser openai or
    --reasoning-parser openai_gptoss)."""
    return tool_parser == tool_formats.HARMONY or reasoning_parser == reasoning.HARMONY


def choice_reader(prep: Prepared) -> tool_output.ChoiceReader | harmony.HarmonyReader:
    """What reads one chat choice's stream into deltas."""
    if prep.harmony:
        plan = prep.tools
        return harmony.HarmonyReader(
            plan and [t["function"]["name"] for t in plan.tools],
            max_calls=None if plan is None or plan.parallel else 1)
    return tool_output.ChoiceReader(prep.tools, prep.think)


class TokenText:
    """The served tokenizer, for the text log-prob entries show (logprob_text)."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids)) if self.tok is not None else ""

    def texts(self, prep: Prepared, index: int) -> TokenTexts:
        """Choice `index`'s generated tokens, decoded after its prompt."""
        return TokenTexts(self.tok, prep.prompts[index // prep.n], prep.tokens_as_ids)


def _top_dict(sampled: Shown, lp: float | None, alts: list[tuple[Shown, float]]) -> dict:
    out = {a.label: lp_a for a, lp_a in alts}
    if lp is not None:
        out.setdefault(sampled.label, lp)
    return out


def completion_logprobs(texts: TokenTexts, ids: list[int], lps: list[float] | None,
                        tops: list | None, *, base: int, final: bool,
                        prompt: tuple[TokenTexts, list[int], list, list | None] | None = None
                        ) -> dict:
    """The `logprobs` object of a completion choice; `prompt` (its texts, ids, lps, tops)
    for echo. `tokens` join to the choice's text."""
    tokens, token_lps, top, offsets = [], [], [], []
    at = base
    if prompt is not None:
        p_texts, p_ids, p_lps, p_tops = prompt
        for k, (s, alts) in enumerate(p_texts.feed(p_ids, p_tops, final=True)):
            lp = p_lps[k] if p_lps is not None and k < len(p_lps) else None
            lp = None if k == 0 or lp is None else float(lp)  # nothing precedes the first
            tokens.append(s.text)
            token_lps.append(lp)
            top.append(None if k == 0 else _top_dict(s, lp, alts))
            offsets.append(at)
            at += len(s.text)
    lps = lps or []
    for k, (s, alts) in enumerate(texts.feed(ids, tops, final=final)):
        lp = float(lps[k]) if k < len(lps) else None
        tokens.append(s.text)
        token_lps.append(lp)
        top.append(_top_dict(s, lp, alts))
        offsets.append(at)
        at += len(s.text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(texts: TokenTexts, ids: list[int], lps: list[float] | None,
                  tops: list | None, *, final: bool) -> dict:
    """Chat `logprobs.content`: tokens join to the message, `bytes` are each token's own."""
    content = []
    for k, (s, alts) in enumerate(texts.feed(ids, tops, final=final)):
        content.append({
            "token": s.text, "logprob": float(lps[k]) if lps and k < len(lps) else None,
            "bytes": list(s.data),
            "top_logprobs": [{"token": a.label, "logprob": lp, "bytes": list(a.data)}
                             for a, lp in alts],
        })
    return {"content": content}


def usage(prep: Prepared, joined: list[Joined] | None) -> dict:
    prompt = sum(len(p) for p in prep.prompts)
    completion = sum(len(j.token_ids) for j in joined or ())
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def completion_choice(prep: Prepared, tt: TokenText, index: int, j: Joined,
                      *, first: bool = True, base: int = 0,
                      texts: TokenTexts | None = None) -> dict:
    """One choice: the whole of it, or a stream chunk's part (`first`: the chunk that
    carries the echo; `base`: characters of this choice already sent, for text_offset;
    `texts`: the choice's token texts so far, when streaming)."""
    p = index // prep.n
    text = j.text
    echo_prompt = None
    if prep.echo and first:
        prompt_text = prep.prompt_texts[p]
        if prompt_text is None:
            prompt_text = tt.decode(prep.prompts[p])
        text = prompt_text + text
        if prep.logprobs is not None:
            echo_prompt = (TokenTexts(tt.tok, (), prep.tokens_as_ids), prep.prompts[p],
                           j.prompt_logprobs, j.prompt_top_logprobs)
    logprobs = None
    if prep.logprobs is not None:
        logprobs = completion_logprobs(texts or tt.texts(prep, index), j.token_ids,
                                       j.logprobs, j.top_logprobs, base=base,
                                       final=j.finish_reason is not None, prompt=echo_prompt)
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": j.finish_reason}


def chat_choice(prep: Prepared, tt: TokenText, index: int, j: Joined) -> dict:
    logprobs = (chat_logprobs(tt.texts(prep, index), j.token_ids, j.logprobs, j.top_logprobs,
                              final=True)
                if prep.logprobs is not None else None)
    if prep.harmony:
        delta, finish_reason = choice_reader(prep).read(j.text, j.token_ids,
                                                        j.finish_reason or "stop")
        message = tool_output.assemble(delta, with_reasoning=True)
    else:
        message, finish_reason = tool_output.message(prep.tools, j.text, j.finish_reason,
                                                     prep.think)
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": finish_reason}
