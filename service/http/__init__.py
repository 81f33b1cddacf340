"""The HTTP door: OpenAI chat/completions, Cohere/Jina and TEI rerank, health and metrics, on the gRPC server's
event loop and engine bridge (docs/http.md). Modules: server.py (uvicorn on the running loop), app.py (routes),
openai_schema.py / rerank_schema.py (pydantic request models to tandem.v1 messages), openai_output.py (tandem.v1
responses to OpenAI JSON), tokens.py (token text for logprobs), errors.py (statuses and each API's error shape)."""
