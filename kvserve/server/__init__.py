"""The OpenAI-compatible HTTP server: ``create_app`` (in ``app``) builds the FastAPI app over
an AsyncLLMEngine; ``run_server`` is what ``kvserve serve`` runs."""
