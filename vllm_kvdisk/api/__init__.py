"""API-server side of kvdisk that is not tool-call replay: :mod:`.tenancy` (the cache salt
per tenant, set on each request before vLLM reads it)."""
