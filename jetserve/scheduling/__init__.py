"""Who runs next and where its KV goes: plain Python that never imports jax.

Three layers, in the vLLM v1 shape:

  scheduler.py         policy: admission (fair per client), page reservation, preemption
                       for recompute, chunked prefill, prefill-before-decode priority
  kv_cache_manager.py  the page questions: does a prefix fit with the next step, does a
                       whole sequence fit beside the ones promised, which pages the prefix
                       cache gives back
  (block pool)         the physical pages, reference counts and the per-slot page table:
                       engines/page_pool.py, held by a paged engine until the engine takes
                       the page table per call (issue 19)
  slots.py             which request holds which decode slot
  plan.py              one turn's decisions (`StepPlan`); orchestrator/step_plan.py is its
                       wire form for several processes

The executors (orchestrator/generate_worker.py, orchestrator/lockstep.py, jetserve/offline.py)
ask these and run what they decide over the Engine API.
"""
