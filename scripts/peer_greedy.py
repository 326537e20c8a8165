"""Greedy-token agreement between servers, before scripts/peer_bench.sh compares their speed.

A speed comparison is only fair when every server runs the same model: each one is asked,
over its own HTTP API, for the same greedy continuation of one fixed token-id prompt, and
the token ids must agree exactly. Two ways of asking:

  - `openai`: `POST /v1/completions` with `"return_tokens_as_token_ids": true` and
    `"logprobs": 0`, so each generated token comes back as `token_id:N` (jetserve, vLLM);
  - `llamacpp`: llama.cpp's own `POST /completion` with `"return_tokens": true`, which
    puts the generated ids in `tokens`.

    python scripts/peer_greedy.py fetch --url http://127.0.0.1:8000 --flavour openai \
        --name vllm --out OUT/greedy_vllm.json
    python scripts/peer_greedy.py compare OUT/greedy_*.json     # exit 1 on a mismatch

Only the standard library: it runs under whichever Python starts the servers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

FLAVOURS = ("openai", "llamacpp")
# Fixed and free of special ids (0-2): BOS first, then ids a byte-level vocabulary also has.
PROMPT = (1, *range(40, 72))


def request_body(flavour: str, prompt: tuple[int, ...], n: int) -> tuple[str, dict]:
    """(path, JSON body) asking for n greedy tokens after `prompt`, EOS ignored."""
    if flavour == "openai":
        return "/v1/completions", {
            "prompt": list(prompt), "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}
    if flavour == "llamacpp":
        return "/completion", {
            "prompt": list(prompt), "n_predict": n, "temperature": 0, "top_k": 1,
            "ignore_eos": True, "return_tokens": True, "cache_prompt": False}
    raise ValueError(f"--flavour must be one of {list(FLAVOURS)}, got {flavour!r}")


def parse_tokens(flavour: str, reply: dict) -> list[int]:
    """The generated token ids in a reply to request_body's request."""
    if flavour == "llamacpp":
        return [int(t) for t in reply["tokens"]]
    tokens = reply["choices"][0]["logprobs"]["tokens"]
    out = []
    for t in tokens:
        prefix, _, num = t.partition(":")
        if prefix != "token_id" or not num.lstrip("-").isdigit():
            raise ValueError(f"expected logprob tokens of the form 'token_id:N', got {t!r}")
        out.append(int(num))
    return out


def mismatch(tokens: dict[str, list[int]]) -> str | None:
    """None when every server produced the same ids; else a message naming who differs where."""
    if len(tokens) < 2:
        raise ValueError(f"need greedy tokens of at least 2 servers, got {list(tokens)}")
    names = list(tokens)
    ref_name, ref = names[0], tokens[names[0]]
    lines = []
    for name in names[1:]:
        got = tokens[name]
        if got == ref:
            continue
        at = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b),
                  min(len(ref), len(got)))
        lines.append(f"{name} differs from {ref_name} at token {at}: {got} vs {ref}")
    if not lines:
        return None
    return ("greedy tokens disagree, so the servers do not run the same model:\n  "
            + "\n  ".join(lines))


def _post(url: str, body: dict, timeout_s: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def fetch(url: str, flavour: str, n: int, *, ready_timeout_s: float) -> list[int]:
    """Asks the server at `url` for n greedy tokens, retrying until it answers or time runs out."""
    path, body = request_body(flavour, PROMPT, n)
    deadline = time.monotonic() + ready_timeout_s
    while True:
        try:
            return parse_tokens(flavour, _post(url.rstrip("/") + path, body, 120))
        except urllib.error.HTTPError as e:
            if e.code != 503:  # 503: loading the model; anything else is an answer
                raise RuntimeError(f"{url}{path} answered {e.code}: {e.read()[:300]!r}") from None
        except (urllib.error.URLError, ConnectionError):
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer within {ready_timeout_s:.0f} s")
        time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="greedy tokens of one server into a JSON file")
    f.add_argument("--url", required=True)
    f.add_argument("--flavour", required=True, choices=FLAVOURS)
    f.add_argument("--name", required=True)
    f.add_argument("--tokens", type=int, default=16)
    f.add_argument("--ready-timeout", type=float, default=900.0)
    f.add_argument("--out", required=True)
    c = sub.add_parser("compare", help="exit 1 unless every file holds the same tokens")
    c.add_argument("files", nargs="+")
    args = p.parse_args(argv)
    if args.cmd == "fetch":
        if args.tokens < 1:
            raise SystemExit(f"--tokens must be >= 1, got {args.tokens}")
        ids = fetch(args.url, args.flavour, args.tokens, ready_timeout_s=args.ready_timeout)
        with open(args.out, "w") as fh:
            json.dump({"name": args.name, "url": args.url, "prompt": list(PROMPT),
                       "tokens": ids}, fh)
        print(f"{args.name}: {ids}")
        return 0
    tokens = {}
    for path in args.files:
        with open(path) as fh:
            rec = json.load(fh)
        tokens[rec["name"]] = rec["tokens"]
    msg = mismatch(tokens)
    if msg:
        print(msg, file=sys.stderr)
        return 1
    print(f"greedy tokens agree across {', '.join(tokens)}: {next(iter(tokens.values()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
