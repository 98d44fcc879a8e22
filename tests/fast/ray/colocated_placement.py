"""The background job `placement` of test_colocation.py (tests/background.py: `python colocated_placement.py placement
OUT_DIR`): a Ray cluster of its own with 2 (declared) GPUs, the placement of a --colocate dmd2 run with 3 engines,
written to OUT_DIR/placement.json: each trainer rank's and engine's GPU ids (stand-in actors that load nothing, placed
with the Ray options the trainer groups and the engine group use)."""

import json
import sys
import tempfile
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from miles.arguments.parser import parse_args  # noqa: E402
from miles.ray.engine_group import engine_options  # noqa: E402
from miles.ray.groups import RunFlags, colocation_for, roles_to_start  # noqa: E402
from miles.ray.train_group import rank_options  # noqa: E402


class StandIn:
    def ids(self):
        return ray.get_gpu_ids()


def main() -> None:
    flags = ["--loss-type", "dmd2", "--teacher-load", "unused", "--hf-checkpoint", "unused", "--device", "cuda"]
    args = parse_args([*flags, "--dp-size", "2", "--rollout-num-engines", "3", "--colocate"])
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, _temp_dir=tempfile.mkdtemp(), log_to_driver=False)
    colocation = colocation_for(RunFlags.from_args(args))
    stand_in = ray.remote(StandIn)
    placement = {}
    for role in roles_to_start(RunFlags.from_args(args)):
        ranks = [
            stand_in.options(**rank_options(args, r, colocation.placement_group, colocation)).remote() for r in (0, 1)
        ]
        placement[role] = [ray.get(rank.ids.remote(), timeout=60) for rank in ranks]
    engines = [stand_in.options(**engine_options(i, 1.0, 1.0, colocation)).remote() for i in range(3)]
    placement["engines"] = [ray.get(e.ids.remote(), timeout=60) for e in engines]
    placement["share"] = colocation.gpu_share
    (Path(sys.argv[2]) / "placement.json").write_text(json.dumps(placement))
    ray.shutdown()


if __name__ == "__main__":
    main()
