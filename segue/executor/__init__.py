"""Executors run a scheduled batch: the torch model executor, and the simulated one."""
