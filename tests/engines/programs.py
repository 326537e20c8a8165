"""What XLA makes of an engine's compiled generate step, for tests of its size and memory."""

import jax


def generate_program(engine, params, state, *table):
    """(HLO instruction count, memory analysis, decode cache bytes) of `engine`'s
    generate step compiled for `state`; a paged engine takes its page table `table`."""
    compiled = engine._generate_jit.lower(params, state, *table, None).compile()
    ops = sum(1 for line in compiled.as_text().splitlines() if " = " in line)
    cache = sum(x.nbytes for x in jax.tree.leaves((state.k, state.v)))
    return ops, compiled.memory_analysis(), cache
