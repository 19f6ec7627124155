"""Parm MoE layer: communication schedules as plans, collectives, cost model and executor.

Words, one thing each:
    piece   one of the r spans of tokens the exchange pipelines; r is the layer's `chunks`
            (the flag --moe-parm-chunks, Parm's name, kept in code and JSON as the flag has it)
    exchange  the plan step that sends tokens to their experts and back (plan.Op.EXCHANGE)
    stretch   (bench/calibration) compute run before a collective, to time the wait at it
"Chunk" alone elsewhere is megatron's model chunk: a virtual pipeline stage (planning/).
"""
