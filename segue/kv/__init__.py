"""Paged KV cache bookkeeping: block pools, prefix caching and per-request block tables (pure Python)."""
