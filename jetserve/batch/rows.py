"""One input row (a JSON object) -> a validated job, or a RowError naming the problem.

Plain functions of a `ModelLimits` snapshot (jetserve.server.validation), so the batch
reader checks fields exactly as the servers do. Two kinds of rows:

- generation: `{"id", "prompt" | "prompt_ids" | "messages", "max_tokens", sampling
  fields, "logit_bias", "stop", "stop_token_ids", "ignore_eos", "logprobs", "model"}` ->
  `GenerateJob`
  (`model`: a LoRA adapter's name, from the job's --lora-modules; absent: the base
  model); the output may be constrained as on HTTP, by one of `response_format`,
  `structured_outputs` or a `guided_*` field (jetserve.server.structured_fields); a
  `messages` row may give chat `tools`, `tool_choice` and `parallel_tool_calls` as
  /v1/chat/completions does (jetserve.server.tool_calls; calls read in the format of
  the job's --tool-call-parser)
- scoring: `{"id", "context" | "context_ids", "continuation" | "continuation_ids",
  "add_bos"}` -> `ScoreJob` (the continuation's summed log-likelihood and whether it is
  greedy). Text is tokenized as lm-eval's `loglikelihood` does: whitespace ending the
  context moves to the continuation, context + continuation are tokenized whole and split
  where the context's own tokens end (so a token spanning the seam goes to the
  continuation); an empty context scores the continuation after BOS alone. `add_bos`
  (text contexts only): whether the context starts with BOS; default the tokenizer's
  config (`add_bos_token`); lm-eval's API and Hugging Face models add none unless given
  `add_bos_token=True`, so rows that must match theirs say `"add_bos": false`.

Either kind may carry `"metadata"` (any JSON), copied to its output row untouched; any
other field is an error (a misspelt "temprature" would otherwise sample greedily).
"""

from __future__ import annotations

import dataclasses
import json
import types
from typing import Any

from jetserve import generation_config
from jetserve.batch import wellformed
from jetserve.request import Request
from jetserve.server import chat_template, tool_calls
from jetserve.server import validation as v
from jetserve.server.structured_fields import CONSTRAINT_FIELDS, constraint_of
from jetserve.server.tool_formats import DEFAULT_PARSER

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                   "frequency_penalty", "presence_penalty", "seed")
# What a row's unset field is when neither --max-tokens nor the model's generation_config
# sets it (jetserve.generation_config.resolve): greedy, 16 tokens.
MAX_TOKENS = 16
ROW_DEFAULTS = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                    frequency_penalty=0.0, presence_penalty=0.0, max_tokens=MAX_TOKENS)
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")  # messages rows only
GENERATE_FIELDS = frozenset(("id", "prompt", "prompt_ids", "messages", "max_tokens", "stop",
                             "logit_bias",
                             "stop_token_ids", "ignore_eos", "logprobs", "metadata", "model",
                             *SAMPLING_FIELDS, *CONSTRAINT_FIELDS, *TOOL_FIELDS))
SCORE_FIELDS = frozenset(("id", "context", "context_ids", "continuation",
                          "continuation_ids", "add_bos", "metadata"))
PROMPT_FIELDS = ("prompt", "prompt_ids", "messages")


class RowError(ValueError):
    """A row that cannot run; its message names the field and the value."""


@dataclasses.dataclass(frozen=True)
class GenerateJob:
    id: Any
    request: Request
    metadata: Any = None
    tools: tool_calls.ToolPlan | None = None  # a chat row's tools in play: calls are read

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def work(self) -> int:
        """Tokens the job may touch: what orders the queue."""
        return len(self.request.prompt_ids) + self.request.max_tokens


@dataclasses.dataclass(frozen=True)
class ScoreJob:
    id: Any
    request: Request  # prompt = context + continuation, max_tokens 0, prompt log-probs
    context_len: int
    metadata: Any = None

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def work(self) -> int:
        return len(self.request.prompt_ids)


Job = GenerateJob | ScoreJob


def row_id(obj: Any) -> Any:
    """The row's id (a string or an integer), or raises RowError."""
    if not isinstance(obj, dict):
        raise RowError(f"a row must be a JSON object, got {type(obj).__name__}")
    if "id" not in obj:
        raise RowError('the row has no "id"; give each row a unique string or integer id')
    rid = obj["id"]
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        raise RowError(f'"id" must be a non-empty string or an integer, got {rid!r}')
    why = wellformed.text_problem(rid) if isinstance(rid, str) else None
    if why:  # the id is written to the output: it must be encodable
        raise RowError(f'"id" contains {why}')
    return rid


def id_key(rid: Any) -> str:
    """A canonical string for an id (1 and "1" stay distinct)."""
    return json.dumps(rid)


def line_key(line: int) -> str:
    """The key of an error row about an input line without a usable id."""
    return f"#line {line}"


def output_key(row: dict) -> str:
    """The key of an output row: what identifies its input row (see journal.py)."""
    if "line" in row:
        return line_key(row["line"])
    return id_key(row["id"])


def parse_line(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise RowError(f"the line is not valid JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:  # json's C decoder stops at Python's recursion limit
        raise RowError("the line is nested too deeply to parse (at most "
                       f"{wellformed.MAX_DEPTH} levels of [ and {{ are accepted)") from None


def build_job(obj: dict, limits: v.ModelLimits, *, default_max_tokens: int | None = None,
              adapters: tuple[str, ...] = (), tool_parser: str = DEFAULT_PARSER) -> Job:
    """The job for a parsed row (its id already checked by `row_id`);
    `default_max_tokens`: a generation row's max_tokens when it sets none (--max-tokens;
    None: the model's default, else MAX_TOKENS); `adapters`: the
    LoRA adapter names its `model` may give; `tool_parser`: the format tool calls are
    read in (--tool-call-parser)."""
    try:
        wellformed.check(obj)
        if any(k in obj for k in ("context", "context_ids", "continuation",
                                  "continuation_ids")):
            return _score_job(obj, limits)
        return _generate_job(obj, limits, default_max_tokens, adapters, tool_parser)
    except v.InvalidArgument as e:
        raise RowError(e.message) from None
    except ValueError as e:  # Request / SamplingParams validation, wellformed.Malformed
        raise RowError(str(e)) from None


def _unknown(obj: dict, allowed: frozenset, kind: str) -> None:
    extra = sorted(k for k in obj if k not in allowed)
    if extra:
        raise RowError(f"unknown field(s) {extra} in a {kind} row; expected some of "
                       f"{sorted(allowed)} (put your own data under \"metadata\")")


def _exactly_one(obj: dict, names: tuple[str, ...], what: str) -> str:
    given = [n for n in names if n in obj]
    if len(given) != 1:
        got = f"got {given}" if given else "got none"
        raise RowError(f"give exactly one of {list(names)} as the {what}, {got}")
    return given[0]


def _generate_job(obj: dict, limits: v.ModelLimits, default_max_tokens: int | None,
                  adapters: tuple[str, ...] = (),
                  tool_parser: str = DEFAULT_PARSER) -> GenerateJob:
    _unknown(obj, GENERATE_FIELDS, "generation")
    kind = _exactly_one(obj, PROMPT_FIELDS, "prompt")
    plan = _tool_plan(obj, kind, tool_parser)
    if kind == "prompt":
        ids = v.encode_text(limits, obj["prompt"], "prompt", add_bos=None)
    elif kind == "prompt_ids":
        ids = v.check_token_ids(limits, obj["prompt_ids"], "prompt_ids")
    else:
        ids = chat_template.chat_prompt_ids(limits, obj["messages"],
                                            tools=plan and plan.tools)
    v.check_prompt_length(limits, ids, kind)
    room = limits.max_seq_len - len(ids)
    asked = {k: obj.get(k) for k in ROW_DEFAULTS}
    if asked["max_tokens"] is None:
        asked["max_tokens"] = default_max_tokens  # --max-tokens, when given
    got = generation_config.resolve(asked, limits.generation, ROW_DEFAULTS, room=room)
    max_tokens = v.check_max_tokens(limits, got.pop("max_tokens"), len(ids))
    sampling = v.sampling_params(**got, seed=obj.get("seed"),
                                 logit_bias=v.logit_bias_pairs(limits, obj.get("logit_bias")))
    logprobs = _logprobs(obj.get("logprobs"), limits)
    ignore_eos = obj.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise RowError(f"ignore_eos must be true or false, got {ignore_eos!r}")
    stops = v.check_stop(obj.get("stop"))
    if stops and limits.tokenizer is None:
        raise RowError("stop: this model has no tokenizer, so stop strings cannot be "
                       "matched; use stop_token_ids")
    constraint = constraint_of(types.SimpleNamespace(**{f: obj.get(f)
                                                        for f in CONSTRAINT_FIELDS}))
    req = Request(prompt_ids=tuple(ids), sampling=sampling, max_tokens=max_tokens,
                  stop_strings=stops,
                  stop_token_ids=v.check_stop_token_ids(limits, obj.get("stop_token_ids")),
                  ignore_eos=ignore_eos, logprobs=logprobs,
                  constraint=tool_calls.output_constraint(plan, constraint),
                  lora_adapter=_adapter(obj.get("model"), adapters))
    return GenerateJob(id=obj["id"], request=req, metadata=obj.get("metadata"), tools=plan)


def _tool_plan(obj: dict, kind: str, parser: str) -> tool_calls.ToolPlan | None:
    given = [f for f in TOOL_FIELDS if obj.get(f) is not None]
    if given and kind != "messages":
        raise RowError(f"{given[0]} needs a chat row: give messages rather than {kind}")
    return tool_calls.plan_tools(obj.get("tools"), obj.get("tool_choice"),
                                 obj.get("parallel_tool_calls"), parser)


def _adapter(model: Any, adapters: tuple[str, ...]) -> str | None:
    if model is None:
        return None
    if model not in adapters:
        raise RowError(f"model {v.show(model)}: no such LoRA adapter (--lora-modules gave "
                       f"{list(adapters)}); leave model out for the base model")
    return model


def _logprobs(value: Any, limits: v.ModelLimits) -> int | None:
    """None / false: none; true: the chosen token's; n: plus the top-n alternatives."""
    if value is None or value is False:
        return None
    if value is True:
        return 0
    return v.check_logprobs(limits, value)


def _score_job(obj: dict, limits: v.ModelLimits) -> ScoreJob:
    _unknown(obj, SCORE_FIELDS, "scoring")
    ck = _exactly_one(obj, ("context", "context_ids"), "context")
    nk = _exactly_one(obj, ("continuation", "continuation_ids"), "continuation")
    add_bos = obj.get("add_bos")
    if add_bos is not None and (not isinstance(add_bos, bool) or ck != "context"):
        raise RowError(f"add_bos must be true or false, for a text context; got "
                       f"{v.show(add_bos)}" + ("" if ck == "context" else " with context_ids"))
    if ck == "context" and nk == "continuation":
        ctx, cont = _split_text(limits, obj["context"], obj["continuation"], add_bos)
    else:
        ctx = (_context_text(limits, obj["context"], add_bos) if ck == "context"
               else v.check_token_ids(limits, obj["context_ids"], "context_ids"))
        cont = (v.encode_text(limits, obj["continuation"], "continuation", add_bos=False)
                if nk == "continuation"
                else v.check_token_ids(limits, obj["continuation_ids"], "continuation_ids"))
    ids = ctx + cont
    cap = min(limits.max_prefill_length, limits.max_seq_len)
    if len(ids) > cap:
        raise RowError(f"context + continuation have {len(ids)} tokens ({len(ctx)} + "
                       f"{len(cont)}); "
                       f"{v.prompt_limit(limits.max_prefill_length, limits.max_seq_len)}")
    # logprobs=1: the top alternative at each position tells whether the token is greedy.
    req = Request(prompt_ids=tuple(ids), max_tokens=0, prompt_logprobs=True,
                  logprobs=min(1, limits.top_logprobs))
    return ScoreJob(id=obj["id"], request=req, context_len=len(ctx),
                    metadata=obj.get("metadata"))


def _split_text(limits: v.ModelLimits, context: Any, continuation: Any,
                add_bos: bool | None) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's `loglikelihood` makes them: the
    context's trailing whitespace moves to the continuation (so " Paris" keeps its space),
    then the whole text is tokenized and split after as many tokens as the context alone
    has."""
    for name, val in (("context", context), ("continuation", continuation)):
        if not isinstance(val, str):
            raise RowError(f"{name} must be a string, got {type(val).__name__}")
    stripped = context.rstrip()
    if len(stripped) < len(context):
        continuation = context[len(stripped):] + continuation
        context = stripped
    if context == "":
        return (_context_text(limits, context, add_bos),
                v.encode_text(limits, continuation, "continuation", add_bos=False))
    ctx = _context_text(limits, context, add_bos)
    whole = v.encode_text(limits, context + continuation, "continuation", add_bos=add_bos)
    if len(whole) <= len(ctx):
        raise RowError(f"continuation {v.show(continuation)} adds no token after the "
                       "context (it merges into the context's last token); give "
                       "context_ids and continuation_ids")
    return ctx, whole[len(ctx):]


def _context_text(limits: v.ModelLimits, context: Any, add_bos: bool | None) -> list[int]:
    if context == "" and limits.bos_id is not None:
        return [limits.bos_id]
    ids = v.encode_text(limits, context, "context", add_bos=add_bos)
    if not ids:
        raise RowError("context tokenized to nothing; give a longer context or context_ids")
    return ids
