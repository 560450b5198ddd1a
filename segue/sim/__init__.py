"""The simulator and its workloads, below bench and cli.

run.py is `segue sim` (a rate x policy sweep); engine.py builds the real LLMEngine over the
virtual-clock SimExecutor; replay.py drives any engine through a trace open-loop (the real engine
on the wall clock too); metrics.py defines TTFT, TPOT and normalized latency once for everyone;
arrivals.py draws arrival times; workloads/ loads the InferCept trace (shipped in data/) and builds
the synthetic and chat mixes.
"""
