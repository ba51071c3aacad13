"""One process that prefills and decodes on one KV pool: the baseline disaggregation is measured against."""
