"""The OpenAI-compatible endpoint an agent program calls: its API, its HTTP server, and how a policy writes a tool call."""
