"""Who runs next and where its KV goes: plain Python that never imports jax.

Three layers, in the vLLM v1 shape:

  scheduler.py         policy of the threaded executor: admission (fair per client), page
                       fit, preemption for recompute, prefill-before-decode priority with
                       chunks of a long prompt between decode steps
  policy.py            the knobs users know from vLLM (max_num_seqs,
                       max_num_batched_tokens, prefill-first or decode-first), checked
                       and resolved against an engine
  step_budget.py       decode-first's token budget between two decode steps of an
                       interleaved engine
  turn_planner.py      policy of the lock-step executor: each turn's releases and
                       admissions under whole-sequence page reservations, as a StepPlan
  kv_cache_manager.py  the page questions: does a prefix fit with the next step, does a
                       whole sequence fit beside the ones promised; pages shared with the
                       prefix cache
  page_pool.py         the block pool: physical pages, reference counts, each slot's
                       pages and the page table the device reads
  page_planner.py      the host side of a paged engine's calls: plans the pages of each
                       insert and generate step and passes the table to the stateless engine
  slots.py             which request holds which decode slot
  plan.py              one turn's decisions (`StepPlan`) and prefill chunk bounds;
                       orchestrator/step_plan.py is the plan's wire form for several
                       processes

The executors (orchestrator/generate_worker.py, orchestrator/lockstep.py, jetserve/offline.py)
ask these, run what they decide over the Engine API, and read results back through one
path (orchestrator/readback.py).
"""
