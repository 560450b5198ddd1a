"""`segue profile`: the costs the scheduler and the simulator reason with, measured on this device.

`steps.py` times whole engine steps and fits the cost model; `scatter.py` the cost of KV blocks
scattered over the pool; `overlap.py` a decode step beside a swap copy.
"""
