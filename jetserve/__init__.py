"""jetserve host runtime: requests, tokenizers, orchestrator, servers, batch, CLI."""

__version__ = "0.1.0"
