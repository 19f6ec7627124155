"""The MoE layer benchmark harness: what tools/bench_moe_layer.py, bench_sweep.py,
validate_cost_model.py, calibrate_comm.py and deepspeed_peer.py run, each tool a thin command
(its flags, a call in here, its output).

One layer, every row alike (harness.run_config):
    flags.py        bench_moe_layer's flags (Megatron-LM's, plus the tool's own), --peers
    layout.py       megatron's process groups for a layout (set up, rebuilt, left), the device
    weights.py      the full weights and data from the seed, each rank's slice, --dump
    replica.py      this rank's replica, the single-process reference on it, the comparison
    timing.py       the timed step, the interleaved timing of the rows, --step-times
    ledger.py       bytes per collective kind from comm.py's ledger; node and unique floors
    harness.py      a row per schedule or peer, checked, timed and counted
    report.py       the JSON config and the table
    results.py      readers of the JSON (a row's time), shared with the tools that read it
    peers/          megatron-core's dispatchers and DeepSpeed's MoE layer as adapters
                    (DeepSpeed imported only when one of its rows is asked for)
Around it:
    sweep.py        bench_sweep's grid and summary
    validation.py   validate_cost_model's grid, folds and scores (cost_fit.py: the layer
                    terms' fit; validation_report.py: its table and plot)
    calibration/    calibrate_comm's measurements, their fit and the profile (report.py)
"""
