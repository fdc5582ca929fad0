"""Canary rollouts over the registry: the analyzer that judges and acts, and the rollout status
operators read. Imports `store` and `domain`."""
