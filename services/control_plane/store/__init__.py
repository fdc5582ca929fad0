"""The registry's persistence: database schema and sessions, the adapter registry, tenants and
keys, worker credentials, audit log, adapter storage (file://, s3://). Imports only `domain`."""
