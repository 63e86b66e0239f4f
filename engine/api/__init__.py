"""The OpenAI-compatible HTTP API that rank 0 serves."""
