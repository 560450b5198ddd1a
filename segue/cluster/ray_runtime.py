"""Starting a private, local Ray instance for `segue serve --engines N`.

Limited CPUs (the engines' own threads do the work; Ray's scheduling only has to fit the actors),
no dashboard, no usage reporting, logs under a fresh temporary directory. An already initialised
Ray (a test's module-scoped cluster, an operator's own `ray.init`) is used as it is and left
running.
"""
from __future__ import annotations

import logging
import os
import tempfile
from typing import Callable

logger = logging.getLogger(__name__)


def start_local_ray(num_cpus: int | None = None) -> Callable[[], None] | None:
    """Start Ray unless it is initialised; returns the function that stops what was started, or None."""
    # Before importing ray: it reads these at import and init. No usage stats: machines may be offline.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return None
    temp_dir = tempfile.mkdtemp(prefix="segue-ray-")
    ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False,
             _temp_dir=temp_dir, configure_logging=False, log_to_driver=True, namespace="segue")
    logger.info("started a local Ray instance (%s CPUs, logs in %s)", num_cpus or os.cpu_count(), temp_dir)
    return ray.shutdown
