"""The OpenAI-compatible HTTP gateway in front of the router (no JAX; by default in the router's
process, `pddjax serve router --openai-port`, else its own, `pddjax serve openai --router`):
`schemas` (pydantic bodies), `translate` (OpenAI request -> GenerateRequest), `answer` (router
messages -> responses and chunks), `errors` (gRPC status -> OpenAI error JSON and HTTP status),
`upstream_api` (`Upstream`: what the gateway needs from a router), `upstream` (it over gRPC;
co-hosted, serving/stack/cohost.py implements it over the router's in-process entry point),
`metrics`, `app` (FastAPI routes, the SSE stream), `server` (uvicorn, alone or co-hosted)."""
