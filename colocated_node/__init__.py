"""One process that prefills and decodes on one KV pool.

The baseline disaggregation is measured against.
"""
