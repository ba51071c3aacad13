"""Bootstrap service: node registry, router, OpenAI-compatible gateway."""
