"""Host cost of closing within max_tokens (jetserve/structured/closing.py) per step: the
grammar's mask alone against the mask narrowed for the budget, over answers drawn at
random from the narrowed masks (any allowed token, however unlikely: the worst text a
model could write) on the bundled model's vocabulary, for the constraints of
tests/jetserve/structured/test_closing.py.

Usage (from the repository root): python scripts/closing_cost.py [--max-tokens 160] [--answers 10]
"""

import argparse
import time

import numpy as np

from jetserve.model_loading import BUNDLED_DIR
from jetserve.structured.grammar import compile_constraint
from jetserve.tokenizer import load_tokenizer
from tests.jetserve.structured.test_closing import CASES as TEST_CASES

CASES = {name: c for name, (c, _) in TEST_CASES.items()}  # the constraints the tests hold


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--answers", type=int, default=10)
    args = ap.parse_args()
    tok = load_tokenizer(BUNDLED_DIR)
    V = 4096
    for name, c in CASES.items():
        plain = narrowed = 0.0
        steps = closed = 0
        for seed in range(args.answers):
            rng = np.random.default_rng(seed)
            g = compile_constraint(c, tok, V)
            for used in range(args.max_tokens):
                t0 = time.perf_counter()
                g.mask_row()
                t1 = time.perf_counter()
                row = g.mask_row(remaining=args.max_tokens - used)
                narrowed += time.perf_counter() - t1
                plain += t1 - t0
                steps += 1
                allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8),
                                                       bitorder="little")[:V])
                t = int(rng.choice(allowed))
                if t in tok.eos_ids or not g.advance(t) or g.stopped:
                    closed += 1
                    break
            else:
                closed += g.matcher.is_accepting()
        print(f"{name}: {closed}/{args.answers} whole within {args.max_tokens} tokens, "
              f"{steps} steps; mask alone {plain / steps * 1e3:.3f} ms/step, "
              f"mask + closing {narrowed / steps * 1e3:.3f} ms/step")


if __name__ == "__main__":
    main()
