"""`gptkit serve`: an OpenAI-compatible HTTP server with continuous batching and a browser playground."""
