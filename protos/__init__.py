"""Protocol buffers: jetstream.proto (wire-compatible with JetStream) and its generated code."""
