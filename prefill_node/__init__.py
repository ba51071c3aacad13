"""Prefill node: radix cache, schedule policy, prefill adder, KV sender loop."""
