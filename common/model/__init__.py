"""Model runner: Llama-family forward on the paged KV pool, weight loaders."""
