"""tools/bench_e2e.py and tools/bench_pipeline.py without launches: they read the training log's
ms/iter and tokens/s, drop the first logged interval (start-up), and refuse a log with too few
intervals; with saves, the wall time between logged lines and what each save held training up;
bench_pipeline the predicted and the measured (megatron's timers) time of each pipeline rank."""

import importlib.util

import pytest

from conftest import ROOT

from parm_trainer.bench import training_runs

spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "tools/bench_e2e.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
spec = importlib.util.spec_from_file_location("bench_pipeline", ROOT / "tools/bench_pipeline.py")
pipeline_tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pipeline_tool)

LOG = """validation (start) at iteration 0 | lm loss 8.975361 | ppl 7905.871
iteration     10/30 | lm loss 7.9 | lr 1.0e-03 | grad norm 1.4 | load_balancing_loss 1.0 | ms/iter 900.0 | tokens/s 2276 | TFLOP/s/device 0.01 | ETA 0.3 min
tokens per expert at iteration 10 | layer 1: 1016 1269 777 1034
iteration     20/30 | lm loss 7.5 | lr 5.0e-04 | grad norm 1.3 | load_balancing_loss 1.0 | ms/iter 400.0 | tokens/s 5120 | TFLOP/s/device 0.01 | ETA 0.1 min
iteration     30/30 | lm loss 7.2 | lr 0.0e+00 | grad norm 1.4 | load_balancing_loss 1.0 | ms/iter 500.0 | tokens/s 4096 | TFLOP/s/device 0.01 | ETA 0.0 min
"""


def test_intervals_and_run_figure():
    rows = tool.intervals(LOG)
    assert rows == [(10, 900.0, 2276.0), (20, 400.0, 5120.0), (30, 500.0, 4096.0)]
    assert tool.run_figure(rows) == pytest.approx(450.0)  # the first interval is start-up
    with pytest.raises(ValueError, match="at least 2 logged intervals"):
        tool.run_figure(rows[:1])


def test_wall_figure_and_save_held():
    assert tool.wall_figure([(5, 10.0), (10, 12.0), (15, 13.5)]) == pytest.approx(350.0)
    log = ("saved checkpoint runs/x/iter_0000005 in 1.25 s\n"
           "saving checkpoint runs/x/iter_0000010 in the background (training went on after "
           "0.40 s)\n"
           "saved checkpoint runs/x/iter_0000010 in 2.00 s (in the background, finalised at "
           "iteration 12; training waited 0.55 s)\n")
    assert tool.save_held(log) == [1.25, 0.55]


def test_commands_run_one_node_or_emulated_nodes(tmp_path):
    (tmp_path / "corpus.idx").write_text("")
    (tmp_path / "tok.model").write_text("")
    args = tool.parse(["--schedules", "s1,megatron", "--out-dir", str(tmp_path), "--data-path",
                       str(tmp_path / "corpus"), "--tokenizer-model", str(tmp_path / "tok.model"),
                       "--", "--bf16"])
    one = tool.command(args, "s1", str(tmp_path / "r"))
    assert one[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert one[one.index("--moe-parm-schedule") + 1] == "s1" and "--sequence-parallel" in one
    assert one[-1] == "--bf16"  # extra flags go last
    assert "--save" not in one
    args.save_interval = 5
    saving = tool.command(args, "s1@async-save", str(tmp_path / "r"))
    assert saving[saving.index("--save") + 1] == str(tmp_path / "r" / "checkpoints")
    assert saving[saving.index("--save-interval") + 1] == "5" and "--async-save" in saving
    args.save_interval = 0
    args.nodes = 2
    two = tool.command(args, "megatron", str(tmp_path / "r"))
    assert two[1].endswith("emulated_cluster.py") and two[two.index("--procs-per-node") + 1] == "2"
    with pytest.raises(SystemExit):
        tool.parse(["--data-path", str(tmp_path / "missing")])


def test_row_names_map_to_flags():
    assert tool.schedule_flags("default") == []
    assert tool.schedule_flags("s1/r2") == ["--moe-parm-schedule", "s1", "--moe-parm-chunks", "2"]
    assert tool.schedule_flags("megatron-allgather") == [
        "--moe-parm-schedule", "megatron", "--moe-token-dispatcher-type", "allgather"]
    assert tool.schedule_flags("auto") == ["--moe-parm-schedule", "auto"]
    assert tool.schedule_flags("s1/r1@timing-log-level=2@overlap-grad-reduce") == [
        "--moe-parm-schedule", "s1", "--moe-parm-chunks", "1", "--timing-log-level", "2",
        "--overlap-grad-reduce"]
    assert tool.schedule_flags("default@timing-log-level=1") == ["--timing-log-level", "1"]
    assert tool.schedule_flags("s1/r2/local") == [
        "--moe-parm-schedule", "s1", "--moe-parm-chunks", "2", "--moe-parm-local-first"]


def test_autos_choice_is_named_as_its_row():
    log = "auto: measured ...; using {}\niteration 10/30 | ms/iter 900.0 | tokens/s 2276"
    assert tool.chosen_row(log.format("s1 with --moe-parm-chunks 2 --moe-parm-local-first")) \
        == "s1/r2/local"
    assert tool.chosen_row(log.format("s2 with --moe-parm-chunks 4")) == "s2/r4"
    assert tool.chosen_row(log.format("s1")) == "s1"
    assert tool.chosen_row("iteration 10/30 | ms/iter 900.0") is None


def test_the_table_names_autos_choice_of_each_run_where_they_differ(capsys):
    """A row whose runs all chose one depth is named by it; where auto chose differently from
    one run to the next, each run's figure carries its own choice (the JSON keeps them all)."""
    def run(ms, chosen):
        return {"ms_per_iter": ms, "wall_ms_per_iter": float("nan"), "save_held_s": [],
                "tokens_per_iter": 2048, "chosen": chosen}

    summary = tool._summary({"default": [run(965.4, "s1/r2"), run(915.3, "s1/r1"),
                                         run(960.4, "s1/r1")],
                             "again": [run(900.0, "s1/r1"), run(910.0, "s1/r1")],
                             "megatron-allgather": [run(1476.2, None)]}, saves=False)
    out = capsys.readouterr().out
    assert "965.4 (s1/r2), 915.3 (s1/r1), 960.4 (s1/r1)" in out and "default=" not in out
    assert "again=s1/r1" in out and "900.0, 910.0" in out and "(s1/r1)" not in out.split(
        "again")[1]
    assert "1476.2" in out and summary["default"]["chosen"] == ["s1/r2", "s1/r1", "s1/r1"]
    assert summary["default"]["ms_per_iter"] == 960.4


TIMED_LOG = """predicted forward + backward per micro-batch (the default profile, x): PP rank 0 12.50 ms, PP rank 1 30.00 ms; 400.0 ms per iteration
iteration      5/10 | lm loss 9.1 | ms/iter 900.0 | tokens/s 2276
times across ranks (ms):
  forward-compute:
     rank  0: 100.00
     rank  1: 200.00
     rank  2: 120.00
     rank  3: 180.00
  backward-compute:
     rank  0: 300.00
     rank  1: 400.00
     rank  2: 280.00
     rank  3: 460.00
  optimizer:
     rank  0: 5.00
"""


def test_stage_times_predicted_and_measured():
    assert training_runs.predicted_stage_ms(TIMED_LOG) == ([12.5, 30.0], 400.0)
    assert training_runs.timer_rows(TIMED_LOG, "optimizer") == {0: 5.0}
    # PP2 over 4 ranks: ranks 0-1 are pipeline rank 0, 2-3 rank 1; max over each, per micro-batch
    assert training_runs.measured_stage_ms(TIMED_LOG, 2, 4, 4) == [150.0, 160.0]
    with pytest.raises(ValueError, match="timing-log-option all"):
        training_runs.timer_rows("iteration 1", "forward-compute")
    with pytest.raises(ValueError, match="predicted forward"):
        training_runs.predicted_stage_ms("iteration 1")


def test_bench_pipeline_rows_and_command(tmp_path):
    (tmp_path / "corpus.idx").write_text("")
    (tmp_path / "tok.model").write_text("")
    args = pipeline_tool.parse(["--layouts", "even,auto,Etttttttt|L", "--data-path",
                                str(tmp_path / "corpus"), "--tokenizer-model",
                                str(tmp_path / "tok.model"), "--", "--num-layers", "4"])
    assert args.rows == ["even", "auto", "Etttttttt|L"]
    even = pipeline_tool.command(args, "even", str(tmp_path / "r"))
    assert "--pipeline-model-parallel-layout" not in even and even[-2:] == ["--num-layers", "4"]
    assert even[even.index("--make-vocab-size-divisible-by") + 1] == "32000"
    auto = pipeline_tool.command(args, "auto", str(tmp_path / "r"), timed=True)
    assert auto[auto.index("--pipeline-model-parallel-layout") + 1] == "auto"
    assert auto[auto.index("--timing-log-option") + 1] == "all"
    with pytest.raises(SystemExit):
        pipeline_tool.parse(["--nproc", "3", "--pp", "2", "--data-path", str(tmp_path / "corpus"),
                             "--tokenizer-model", str(tmp_path / "tok.model")])


def test_plan_check_picks_and_ranks():
    from parm_trainer.bench.plan_check import pick, run_agreement, spearman

    assert pick(30, 12, 4) == list(range(12)) + [12, 18, 23, 29]  # spread, the last included
    assert pick(14, 12, 4) == list(range(14))
    assert pick(5, 12, 4) == list(range(5))
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # against the textbook formula 1 - 6 sum d^2 / (n (n^2 - 1)) (no ties)
    a, b = [3.1, 1.2, 5.0, 2.2, 4.4], [2.0, 1.0, 4.0, 5.0, 3.0]
    assert spearman(a, b) == pytest.approx(1 - 6 * (1 + 0 + 1 + 9 + 1) / (5 * 24))
    assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(0.8660254)  # ties share a rank
    # the bench against itself: the median over pairs of repeats
    runs = [[1.0, 1.1, 3.0], [2.0, 1.0, 2.0], [3.0, 3.0, 1.0]]  # three layouts, three repeats
    pairs = [spearman([1, 2, 3], [1.1, 1.0, 3.0]), spearman([1, 2, 3], [3, 2, 1]),
             spearman([1.1, 1.0, 3.0], [3, 2, 1])]
    assert pairs == pytest.approx([0.5, -1.0, -0.5])
    assert run_agreement(runs) == pytest.approx(-0.5)
    assert run_agreement([[1.0, 1.0], [2.0, 2.0]]) == pytest.approx(1.0)
    assert run_agreement([[1.0], [2.0, 3.0]]) is None  # fewer than 2 repeats of a layout


def test_the_benchmarks_demo_model_is_make_demos(tmp_path):
    """DEMO_MODEL (bench_e2e's and bench_plan's default) trains the model scripts/demo_gpt_moe.sh
    launches: the demo's launch is read from a stand-in interpreter, and every field that shapes
    the model, its work or its batch parses the same from both."""
    import os
    import subprocess

    from parm_trainer.arguments import parse_args

    python = tmp_path / "python"
    python.write_text('#!/bin/bash\necho "LAUNCH $*"\nexit 7\n')  # the demo stops at its launch
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python), "RUN_DIR": str(tmp_path / "run")}
    run = subprocess.run(["bash", "scripts/demo_gpt_moe.sh"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    launch = [line for line in run.stdout.splitlines() if line.startswith("LAUNCH")]
    assert run.returncode == 7 and launch, run.stdout + run.stderr
    demo_flags = launch[0].split("pretrain_gpt_moe.py ", 1)[1].split()
    demo = parse_args(demo_flags, world_size=4)
    bench = parse_args(training_runs.DEMO_MODEL + demo_flags[demo_flags.index(
        "--tensor-model-parallel-size"):demo_flags.index("--micro-batch-size")], world_size=4)
    fields = ["num_layers", "hidden_size", "num_attention_heads", "seq_length",
              "normalization", "swiglu", "position_embedding_type", "hidden_dropout",
              "attention_dropout", "disable_bias_linear", "num_experts", "moe_router_topk",
              "moe_ffn_hidden_size", "moe_aux_loss_coeff", "micro_batch_size",
              "global_batch_size", "tensor_model_parallel_size", "expert_model_parallel_size",
              "expert_tensor_parallel_size", "sequence_parallel", "overlap_grad_reduce",
              "overlap_moe_expert_parallel_comm"]
    assert {f: getattr(bench, f) for f in fields} == {f: getattr(demo, f) for f in fields}
    # the scripts' defaults; OVERLAP_GRAD_REDUCE=0 and OVERLAP_MOE_COMM=0 turn them off
    assert demo.overlap_grad_reduce and demo.overlap_moe_expert_parallel_comm
    for variable, flag in (("OVERLAP_GRAD_REDUCE", "--overlap-grad-reduce"),
                           ("OVERLAP_MOE_COMM", "--overlap-moe-expert-parallel-comm")):
        run = subprocess.run(["bash", "scripts/demo_gpt_moe.sh"], cwd=ROOT, capture_output=True,
                             env={**env, variable: "0"}, text=True, timeout=60)
        assert flag not in run.stdout and "--train-iters" in run.stdout, variable
