"""Data-parallel gradients all-reduced node by node (parm_trainer/node_reduce.py,
training/node_buckets.py) are the flat ring's sums: on 4 gloo ranks as two nodes of two
(--ranks-per-node 2), tensors of every size (fewer elements than a node's ranks included),
synchronous and asynchronous, equal gloo's all_reduce; the project's DDP, its dense and expert
buckets and the tied embedding's paced pieces reduced node by node, gives every parameter the
main_grad of megatron-core's plain DistributedDataParallel, with and without
--overlap-grad-reduce; --no-grad-reduce-by-node builds nothing."""

from conftest import run_rank_workers


def test_gradients_reduced_node_by_node_are_the_flat_sums(tmp_path):
    reports = run_rank_workers(tmp_path, "worker_node_reduce.py", 4, timeout=240)
    assert len(reports) == 4
    assert len({r["checks"] for r in reports}) == 1 and reports[0]["checks"] > 20, reports
