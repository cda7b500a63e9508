"""The OpenAI-compatible HTTP server: `inferd serve`."""
