"""A run on a two-node Ray cluster built on this machine (`ray.cluster_utils.Cluster`: two raylets, each with its own
logical CPUs), the stand-in for docs/user-guide/multi-node.md's `ray start --head` / `ray start --address` and then
`train_diffusion.py --ray-address ...`: one trainer rank per node (a rank's CPU share fits once per node), the engine
on either, and the process group meeting at rank 0's node IP. It trains, and `placement.json` shows the ranks on two
nodes.

The cluster and the run live in a subprocess (this file run as a script: the background job `two-nodes`, started with
the session, tests/background.py), apart from the suite's session Ray cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import pytest

pytestmark = pytest.mark.e2e
HERE = os.path.dirname(os.path.abspath(__file__))
NODE_CPUS = 2  # per node; a rank asks for 1.5, so two ranks never share a node


def run_on_two_nodes(output_dir: str) -> None:
    import ray
    from ray.cluster_utils import Cluster

    import train_diffusion
    from miles.arguments.parser import parse_args

    temp_dir = tempfile.mkdtemp(prefix="r2n", dir="/tmp")  # short: Ray's socket paths live under it
    # Cluster.add_node writes the head's address to <default temp dir>/ray/ray_current_cluster without creating the
    # folder (ray.init would have): on a machine where no Ray ran before, /tmp/ray does not exist. Point that default
    # at this run's own folder, so the file neither fails nor lands in a folder other runs share.
    os.environ["RAY_TMPDIR"] = temp_dir
    os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={"num_cpus": NODE_CPUS, "include_dashboard": False, "temp_dir": temp_dir},
    )
    try:
        cluster.add_node(num_cpus=NODE_CPUS)
        cluster.wait_for_nodes()
        args = parse_args(
            [
                "--ray-address",
                cluster.address,
                "--loss-type",
                "policy_loss",
                "--custom-rm-path",
                os.path.join(HERE, "rewards.py") + ":brightness",
                "--dp-size",
                "2",
                "--cpus-per-rank",
                "1.5",
                "--rollout-cpus-per-engine",
                "0.25",
                "--rm-num-workers",
                "1",
                "--num-rollout",
                "2",
                "--rollout-batch-size",
                "2",
                "--n-samples-per-prompt",
                "2",
                "--diffusion-num-steps",
                "4",
                "--diffusion-num-sde-steps",
                "2",
                "--micro-batch-size",
                "2",
                "--eval-interval",
                "0",
                "--image-grid-interval",
                "0",
                "--no-progress",
                "--output-dir",
                output_dir,
            ]
        )
        train_diffusion.run(args)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.background("tests/e2e/test_multi_node.py", "two-nodes")
def test_ranks_on_two_nodes_train_together(background_job):
    out = background_job / "run"
    placement = json.loads((out / "placement.json").read_text())
    rank_nodes = [entry["node_id"] for entry in placement["actor"]]
    assert len(rank_nodes) == 2 and len(set(rank_nodes)) == 2, placement  # one rank per node
    assert placement["engines"][0]["node_id"] in rank_nodes
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    windows = [r for r in records if r.get("role") == "actor" and "train/loss" in r]
    assert len(windows) >= 2, records  # both rollouts trained
    assert all(w["train/grad_norm"] > 0 for w in windows), windows  # gradients crossed the two-node group


if __name__ == "__main__":  # the background job (tests/background.py): python test_multi_node.py two-nodes OUT_DIR
    run_on_two_nodes(os.path.join(sys.argv[2], "run"))
