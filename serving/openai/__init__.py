"""The OpenAI-compatible HTTP gateway in front of the router (its own process, no JAX):
`schemas` (pydantic bodies), `translate` (OpenAI request -> GenerateRequest), `answer` (router
messages -> responses and chunks), `errors` (gRPC status -> OpenAI error JSON and HTTP status),
`upstream` (the router's gRPC channel), `metrics`, `app` (FastAPI routes), `server` (uvicorn)."""
