"""Shared by every role: config, messages, KV pool, model runner, sampler, tokenizer."""
