"""The OpenAI-compatible HTTP gateway in front of the router (no JAX; by default in the router's
process, `pddjax serve router --openai-port`, else its own, `pddjax serve openai --router`):
`schemas` (pydantic bodies), `translate` (OpenAI request -> GenerateRequest), `answer` (router
messages -> responses and chunks), `errors` (gRPC status -> OpenAI error JSON and HTTP status),
`upstream` (the router's gRPC channel), `local` (the router's generate path in its own process),
`metrics`, `app` (FastAPI routes, the SSE stream), `server` (uvicorn, alone or co-hosted)."""
