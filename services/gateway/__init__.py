"""The gateway: authenticates, routes to a version and a worker, forwards the token stream."""
