"""The router of router.proto: one `Generate` in front of the P / RLD / MD instances.

service (RouterService: composes the rest, Generate's stages) -> validate (the request read
and checked), admission (slots, deadlines), choose (instances, hits, the auto decision, MD's
reservation), transfer (P's events, RLD's handoff, release, context sync), recovery (a tier
failing mid-request), stream (the tiers' token streams -> the user's); request (the one
per-request object), pools (instances, health, stubs), estimates (measured link and RLD speeds),
metrics (Prometheus)."""
