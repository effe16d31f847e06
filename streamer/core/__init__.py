"""The scheduler's world: requests, the paged KV cache, step planning against a time budget."""
