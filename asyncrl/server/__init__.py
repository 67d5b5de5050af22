"""The OpenAI-compatible server over the embedded engine (`asyncrl serve`) and asyncrl's own endpoints beside it."""
