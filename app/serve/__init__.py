"""`kvchat serve`: the OpenAI-compatible local API (a face, beside cli and tui)."""
