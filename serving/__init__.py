"""The PDD serving layer: gRPC services for P, RLD and MD, the router, the WAN link proxy and
`pddjax up`. The only package that imports generated protobuf code (`serving.pb`)."""
