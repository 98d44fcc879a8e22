"""Each role's save folder gets its own lock and latest pointer; a run resumes only where every role agrees."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from miles.arguments.parser import parse_args
from miles.backends.fsdp_utils.checkpoint import LATEST_FILE, read_latest
from miles.ray.checkpoint_folders import (
    ResumeMismatchError,
    ResumeSettingsError,
    check_resume_settings,
    check_roles_agree,
    lock_save_folders,
    save_folders,
    write_latest_pointers,
)
from miles.startup import startup_checks
from miles.utils.locks import FolderLockedError


def dmd2(*extra):
    return parse_args(["--hf-checkpoint", "unused", "--loss-type", "dmd2", "--teacher-load", "unused", *extra])


def saved(folder, role, *rollouts):
    """A folder whose latest pointer names the last of `rollouts` (complete role dirs: meta.json present)."""
    for rollout_id in rollouts:
        role_dir = os.path.join(folder, f"iter_{rollout_id:07d}", role)
        os.makedirs(role_dir, exist_ok=True)
        open(os.path.join(role_dir, "meta.json"), "w").close()
        with open(os.path.join(folder, LATEST_FILE), "w") as f:
            f.write(f"{rollout_id}\n")
    return str(folder)


def test_critic_load_defaults_to_the_critics_own_folder(tmp_path):
    a, b = saved(tmp_path / "a", "actor", 1), saved(tmp_path / "b", "critic", 1)
    shared = dmd2("--save", a, "--load", a)
    assert (shared.critic_save, shared.critic_load) == (a, a)  # one folder: the critic resumes with the actor
    separate = dmd2("--save", a, "--load", a, "--critic-save", b)
    assert (separate.critic_save, separate.critic_load) == (b, b)  # its own folder: it resumes from there
    fresh = dmd2("--save", a, "--critic-save", b)
    assert fresh.critic_load is None  # no --load: nobody resumes
    explicit = dmd2("--load", a, "--critic-load", a, "--critic-save", b)
    assert explicit.critic_load == a
    critic_only = dmd2("--critic-save", b, "--save-interval", "1")
    assert save_folders(critic_only, ["critic", "actor"]) == {"critic": b}


def test_roles_that_would_resume_at_different_rollouts_are_refused_naming_them(tmp_path):
    a, b = saved(tmp_path / "a", "actor", 1, 3), saved(tmp_path / "b", "critic", 1)
    args = dmd2("--save", a, "--load", a, "--critic-save", b)
    with pytest.raises(
        ResumeMismatchError,
        match=rf"critic resumes after rollout 1 \(--critic-load {b}\); actor resumes after rollout 3 \(--load {a}\)",
    ):
        check_roles_agree(args, ["critic", "actor"])
    empty = dmd2("--save", a, "--load", a, "--critic-save", str(tmp_path / "new"))
    with pytest.raises(ResumeMismatchError, match=r"critic starts fresh at rollout 0 \(--critic-load .*new\)"):
        check_roles_agree(empty, ["critic", "actor"])
    saved(b, "critic", 3)
    check_roles_agree(args, ["critic", "actor"])
    with pytest.raises(ResumeMismatchError, match="actor resumes after rollout 3"):  # what the groups loaded
        check_roles_agree(args, ["critic", "actor"], {"critic": 0, "actor": 4})


def test_each_save_folder_gets_its_own_pointer(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, role in ((a, "actor"), (b, "critic")):
        os.makedirs(folder / "iter_0000002" / role)
        (folder / "iter_0000002" / role / "meta.json").write_text("{}")
    write_latest_pointers({"critic": str(b), "actor": str(a)}, 2)
    assert read_latest(str(a)) == 2 and read_latest(str(b)) == 2


def test_a_run_locks_both_save_folders(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    locks = lock_save_folders(dmd2("--save", a, "--critic-save", b))
    with pytest.raises(FolderLockedError, match=f"--critic-save {b} is in use by another run \\(pid {os.getpid()}"):
        lock_save_folders(dmd2("--save", str(tmp_path / "c"), "--critic-save", b))
    locks.release()


def lora_checkpoint(folder, rank, *, in_meta=True):
    """A complete actor checkpoint of rollout 2 trained with a rank-`rank` adapter (None: full weights), recorded in
    meta.json or, as checkpoints before the record, only in the stored keys."""
    role_dir = os.path.join(saved(folder, "actor", 2), "iter_0000002", "actor")
    with open(os.path.join(role_dir, "meta.json"), "w") as f:
        json.dump({"rollout_id": 2, "role": "actor", **({"lora_rank": rank} if in_meta else {})}, f)
    if not in_meta:
        key = "model.blocks.0.to_q." + ("lora_A.default.weight" if rank else "weight")
        dcp.save({key: torch.zeros(rank or 8, 8)}, checkpoint_id=os.path.join(role_dir, "dcp"))
    return str(folder)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process, on purpose
@pytest.mark.parametrize("in_meta", [True, False], ids=["meta.json", "stored keys"])
def test_a_lora_checkpoint_resumed_without_use_lora_names_the_flag(tmp_path, in_meta):
    folder = lora_checkpoint(tmp_path / "run", 4, in_meta=in_meta)
    args = parse_args(["--load", folder])
    with pytest.raises(ResumeSettingsError) as err:
        check_resume_settings(args, ["actor"])
    assert str(err.value) == (
        f"--load {folder} (rollout 2, actor) holds a rank-4 LoRA adapter, not full weights: resume it with "
        "--use-lora --lora-rank 4"
    )
    with pytest.raises(ResumeSettingsError, match=r"this run has --lora-rank 8: resume it with --lora-rank 4$"):
        check_resume_settings(parse_args(["--load", folder, "--use-lora"]), ["actor"])
    check_resume_settings(parse_args(["--load", folder, "--use-lora", "--lora-rank", "4"]), ["actor"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process, on purpose
@pytest.mark.parametrize("in_meta", [True, False], ids=["meta.json", "stored keys"])
def test_a_full_checkpoint_resumed_with_use_lora_names_the_flag(tmp_path, in_meta):
    folder = lora_checkpoint(tmp_path / "run", None, in_meta=in_meta)
    with pytest.raises(ResumeSettingsError, match=r"holds full weights, .*: resume it without --use-lora$"):
        check_resume_settings(parse_args(["--load", folder, "--use-lora"]), ["actor"])
    check_resume_settings(parse_args(["--load", folder]), ["actor"])


def test_the_start_up_checks_refuse_it_before_any_actor(tmp_path):
    folder = lora_checkpoint(tmp_path / "run", 4)
    with pytest.raises(ResumeSettingsError, match="--use-lora --lora-rank 4"):
        startup_checks(parse_args(["--load", folder, "--save", folder]))
