"""The OpenAI-compatible server (`python -m v1 serve`)."""
