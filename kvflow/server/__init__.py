"""The OpenAI-compatible HTTP server (FastAPI + uvicorn): protocol, serving, metrics, launcher."""
