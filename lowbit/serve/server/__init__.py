"""The OpenAI-compatible HTTP server: request bodies, the FastAPI app, the engine thread, the CLI."""
