"""OpenAI-compatible HTTP server over an engine (see sparseinfer.engine)."""
