"""The OpenAI-compatible HTTP server (`compiled-engine serve`); `api_server.build_app` is the entry."""
