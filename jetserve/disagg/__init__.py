"""Disaggregated serving across processes and hosts: `jetserve serve --role prefill`
workers run prompts and hold each prefix for a pull; a `--role decode` process serves the
APIs, asks the least loaded worker to prefill, streams the first token, pulls the prefix
(jax.experimental.transfer) into its own layout, inserts it and generates.

  prefix_wire.py         what a prefix looks like on the wire; the checks before a pull
  kv_transfer.py         KVSender (hold until ack or timeout) and KVReceiver (pull)
"""
