"""Run as a script by test_colocation.py: a Ray cluster of its own with 2 (declared) GPUs, the placement of a
--colocate dmd2 run with 3 engines, printed as JSON: each trainer rank's and engine's GPU ids (no model is loaded:
the ranks are the real actor class before `init`, the engines stand-ins with the real engine options)."""

import json
import sys
import tempfile
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import train_diffusion  # noqa: E402
from miles.ray.colocation import actor_gpu_slots  # noqa: E402
from miles.ray.engine_group import engine_options  # noqa: E402
from miles.utils.arguments import parse_args  # noqa: E402


class Engine:
    def ids(self):
        return ray.get_gpu_ids()


def main() -> None:
    flags = ["--loss-type", "dmd2", "--teacher-load", "unused", "--hf-checkpoint", "unused", "--device", "cuda"]
    args = parse_args([*flags, "--dp-size", "2", "--rollout-num-engines", "3", "--colocate"])
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, _temp_dir=tempfile.mkdtemp(), log_to_driver=False)
    colocation = train_diffusion.create_colocation(args)
    groups = train_diffusion.launch_groups(args, colocation)
    engine_cls = ray.remote(Engine)
    engines = [engine_cls.options(**engine_options(i, 1.0, 1.0, colocation)).remote() for i in range(3)]
    placement = {role: actor_gpu_slots(group.actors, timeout=60) for role, group in groups.items()}
    placement["engines"] = [ray.get(e.ids.remote(), timeout=60) for e in engines]
    placement["share"] = colocation.gpu_share
    print(json.dumps(placement))
    ray.shutdown()


if __name__ == "__main__":
    main()
