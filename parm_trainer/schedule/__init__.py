"""Which Parm schedule, exchange depth and shared-expert place each MoE layer runs: chosen once
at start-up, above the models. auto.py prices the candidates with the cost model before the
process groups start (--moe-parm-cost-profile, or the built-in profile for the memory estimate);
tune.py, once the groups exist, measures them on the layer itself where no profile was given
(cached). training/initialize.py calls the two in that order.
"""
