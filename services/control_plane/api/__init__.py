"""The control plane's gRPC edge: the admin servicer, PlacementService (placements to workers,
routing table to gateways), interceptors (auth, the one error mapping), protobuf conversion,
metrics, the server that assembles them, and the admin client."""
