"""The gRPC (JetStream-compatible) and HTTP (OpenAI-compatible) servers over the orchestrator."""
