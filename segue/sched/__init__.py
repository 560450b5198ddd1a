"""Iteration-level scheduling: budgets, queues and pluggable policies (pure Python)."""
