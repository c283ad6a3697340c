"""Serving: an OpenAI-compatible server over a continuous-batching engine."""
