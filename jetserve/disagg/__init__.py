"""Disaggregated serving across processes and hosts: `jetserve serve --role prefill`
workers run prompts and hold each prefix for a pull; a `--role decode` process serves the
APIs, asks the least loaded worker to prefill, streams the first token, pulls the prefix
(jax.experimental.transfer) into its own layout, inserts it and generates.

  prefix_wire.py         what a prefix looks like on the wire; the checks before a pull
  kv_transfer.py         KVSender (hold until ack or timeout) and KVReceiver (pull)
  prefill_runner.py      a prefill worker's thread: prefill, register, complete the job
  prefill_lockstep.py    the same over several processes (one engine, jobs in lock step)
  prefill_service.py     its gRPC service (protos/prefill_worker.proto): Prefill, Ack, Load
  prefill_client.py      the decode side's stubs: start-up checks, least loaded, down marks
  remote_prefill.py      the decode side's prefill threads: ask a worker, stream, retry
  pull_worker.py         the decode side's transfer stage: bounded pulls, ack, retry
  decode_orchestrator.py the decode side's orchestrator (driver.py with remote prefill)
  roles.py               `jetserve serve --role prefill|decode|both`
"""
