"""How a model writes tool calls in its text: the formats `--tool-call-parser` names.

A format is data read by jetserve.server.tool_output.CallReader: where a block of calls
opens, what separates the calls in it and what closes it. Each call is one JSON object
`{"name": ..., "arguments": {...}}` (Llama 3.x writes "parameters"; both are read).

- hermes (the default; the bundled model's template, Hermes and Qwen templates):
  `<tool_call>{...}</tool_call>`, one call per block, anywhere in the text.
- llama3_json: Llama 3.x's bare JSON, `{"name": ..., "parameters": {...}}`, only at the
  start of the output (after an optional `<|python_tag|>`), several calls joined by `;`.
- mistral: `[TOOL_CALLS][{...}, {...}]`. The marker is a special token, which decoding
  drops, so a JSON list of calls at the start of the output is read as well.

Formats that are not JSON call objects (qwen3_coder, glm45, deepseek_v3, pythonic) are
read by their own parsers (jetserve.server.call_blocks), and gpt-oss's harmony ("openai")
by openai-harmony (jetserve.server.harmony). NAMES lists every parser.

Forced calls (tool_choice "required" or named) are generated under a JSON schema in one
of two fixed shapes, whatever the parser: one object, or (required with parallel tool
calls) a JSON list of them.
"""

from __future__ import annotations

import dataclasses

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CallFormat:
    """Where calls sit in a model's text.

    Args:
      marker: text that opens a block of calls, wherever it appears ("" for none).
      at_start: a block may also open at the start of the output without the marker.
      opener: text after the marker, before the first call ("[" for a list).
      sep: text between two calls of one block ("": one call per block).
      close: text that ends a block ("": the block ends after its last call).
    """

    marker: str = ""
    at_start: bool = False
    opener: str = ""
    sep: str = ""
    close: str = ""

    def __post_init__(self):
        if not (self.marker or self.at_start):
            raise ValueError("marker is empty and at_start is False: no call could open")
        if self.opener and not self.sep and not self.close:
            raise ValueError("opener needs a close (or a sep): a list must end")


PARSERS = {
    "hermes": CallFormat(marker=TOOL_CALL_OPEN, close=TOOL_CALL_CLOSE),
    "llama3_json": CallFormat(marker="<|python_tag|>", at_start=True, sep=";"),
    "mistral": CallFormat(marker="[TOOL_CALLS]", at_start=True, opener="[", sep=",",
                          close="]"),
}
HARMONY = "openai"  # vLLM's name for gpt-oss's calls (commentary channel, harmony)
NAMES = (*PARSERS, "qwen3_coder", "pythonic", "deepseek_v3", "glm45", HARMONY)
DEFAULT_PARSER = "hermes"  # the format the bundled model's chat template writes
FORCED_ONE = CallFormat(at_start=True)
FORCED_LIST = CallFormat(at_start=True, opener="[", sep=",", close="]")


def check_parser(name: str, field: str = "--tool-call-parser") -> str:
    """`name` if it is a parser; else ValueError naming `field` and the choices."""
    if name not in NAMES:
        raise ValueError(f"{field} must be one of {', '.join(NAMES)}, got {name!r}")
    return name
