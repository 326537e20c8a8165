"""A hash of the generate program one checkout lowers, to tell whether two checkouts
run the same decode step (equal hashes: the same program, so any timing difference
between them is the machine's noise).

    cd CHECKOUT && PYTHONPATH=$PWD python scripts/step_program_hash.py [--model M] [--batch B]

Builds the engine for `--model` with B slots in both KV layouts, lowers its jitted
generate step (abstract parameters: nothing is loaded or run) and prints, per layout,
the first 16 hex digits of the SHA-256 of the program text with its source locations
removed (those name files and lines, which differ between checkouts), and the text's
length.
"""

from __future__ import annotations

import argparse
import hashlib
import re


def main() -> None:
    import jax

    from engines import EngineConfig
    from jetserve.model_loading import build_engine
    from jetserve.scheduling.page_planner import with_pages

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:llama-156m")
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    for layout in ("contiguous", "paged"):
        engine = build_engine(args.model, engine_config=EngineConfig(
            max_concurrent_decodes=args.batch, max_seq_len=256, max_prefill_length=64,
            kv_layout=layout))
        params = jax.eval_shape(engine.load_params)
        state = engine.init_decode_state()
        if layout == "paged":  # the page table is an argument of the stateless engine
            planner = with_pages(engine)
            table = planner.kv_pages.table[:, :planner.generate_widths()[0]]
            text = engine._generate_jit.lower(params, state, table, None).as_text()
        else:
            text = engine._generate_jit.lower(params, state, None).as_text()
        text = re.sub(r"loc\(.*?\)", "", text)
        text = re.sub(r"#loc\d*[^\n]*", "", text)
        print(layout, hashlib.sha256(text.encode()).hexdigest()[:16], len(text), flush=True)


if __name__ == "__main__":
    main()
