"""Helpers shared by the gRPC servers: errors to status codes, health, reflection, metrics,
graceful shutdown."""
