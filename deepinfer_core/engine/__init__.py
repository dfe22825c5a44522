"""The engine: scheduling, KV cache management, model execution and host-side KV tiers."""
