"""Building the scheduling side of an engine from its config: the KV manager, the ordering and
interception policies (with what they read: cost model, tool statistics) and the scheduler."""
from __future__ import annotations

from segue.config import EngineConfig
from segue.executor.base import Executor
from segue.kv.manager import KVCacheManager
from segue.sched.cost_model import CostModel
from segue.sched.interception import make_interception_policy
from segue.sched.policies import PolicyContext, make_policy
from segue.sched.scheduler import Scheduler
from segue.tools.stats import DurationStats


def build_scheduler(config: EngineConfig, executor: Executor, max_model_len: int, cost_model: CostModel,
                    tool_stats: DurationStats) -> Scheduler:
    kv = KVCacheManager(executor.block_size, executor.num_device_blocks, executor.num_host_blocks,
                        config.cache.enable_prefix_caching, config.cache.prefix_cache_salt)
    interception = make_interception_policy(config.scheduler.interception_policy)
    if hasattr(interception, "quantile_fn"):
        interception.quantile_fn = lambda tool, q: tool_stats.quantile(tool, q) if tool else None
    pool_tokens = executor.num_device_blocks * executor.block_size
    policy_context = PolicyContext(cost_model, pool_tokens, executor.block_size, tool_stats,
                                   dict(config.scheduler.policy_options))
    return Scheduler(config.scheduler, kv, make_policy(config.scheduler.policy, policy_context),
                     max_model_len, interception, cost_model)
