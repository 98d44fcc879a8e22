"""A device that fills during a checkpoint save: the error names the save folder's flag, the iteration and the
bytes; the partial save is removed and the previous checkpoint stays the latest and loadable. A device with too
little room is warned about before a save, and after a save that leaves no room for the next."""

from __future__ import annotations

import errno
import io
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections import namedtuple
from contextlib import contextmanager
from datetime import timedelta

import pytest
from torch.distributed.checkpoint import filesystem

from miles.backends.fsdp_utils import checkpoint_space
from miles.backends.fsdp_utils.checkpoint import load_checkpoint, read_latest, save_checkpoint, write_latest
from miles.backends.fsdp_utils.checkpoint_space import CheckpointSpaceError
from miles.utils.distributed import destroy_process_group, find_free_port, init_process_group
from tests.fast.backends.fsdp_utils.fsdp_workers import build_trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
Usage = namedtuple("Usage", "total used free")
MESSAGE = (
    r"no space left on the device of --save {dir} while saving iteration 2 \((\d+) bytes written, about (\d+) "
    r"needed: .*\); removed the partial iter_0000002/actor, and the latest checkpoint is still iteration 1, intact"
)


@pytest.fixture(scope="module")
def world_of_one():
    init_process_group(0, 1, "127.0.0.1", find_free_port(), "cpu", timeout=timedelta(seconds=60))
    yield
    destroy_process_group()


@pytest.fixture
def trainer(world_of_one):
    model, optimizer, scheduler = build_trainer(0)
    return {"model": model, "optimizer": optimizer, "lr_scheduler": scheduler}


class _FillingStream(io.RawIOBase):
    """A file that takes `room` bytes, then fails as a full disk does: OSError(ENOSPC) or, as torch reports it
    through its zip writer, a bare RuntimeError."""

    def __init__(self, stream, room: list[int], how: str) -> None:
        self.stream, self.room, self.how = stream, room, how

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > self.room[0]:
            self.stream.write(memoryview(data)[: self.room[0]])
            self.room[0] = 0
            if self.how == "enospc":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        self.room[0] -= size
        return self.stream.write(data)

    def tell(self) -> int:
        return self.stream.tell()

    def seek(self, *args) -> int:
        return self.stream.seek(*args)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()


def fill_after(monkeypatch, room: int, how: str) -> None:
    left = [room]
    real = filesystem.FileSystem.create_stream

    @contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            yield _FillingStream(stream, left, how) if "w" in mode else stream

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)


@pytest.mark.parametrize("how", ["enospc", "torch"])
def test_a_device_that_fills_during_a_save_is_named_and_the_previous_checkpoint_stays(
    tmp_path, trainer, monkeypatch, how
):
    save_dir = str(tmp_path / "ckpt")
    save_checkpoint(save_dir, 1, "actor", **trainer)
    write_latest(save_dir, 1)
    fill_after(monkeypatch, 4096, how)
    if how == "torch":  # torch says nothing of the disk: the free space left tells
        monkeypatch.setattr(checkpoint_space.shutil, "disk_usage", lambda path: Usage(10**9, 10**9, 0))
    with pytest.raises(CheckpointSpaceError, match=MESSAGE.format(dir=save_dir)) as caught:
        save_checkpoint(save_dir, 2, "actor", **trainer)
    written, needed = (int(x) for x in re.search(r"\((\d+) bytes written, about (\d+)", str(caught.value)).groups())
    assert 4096 <= written < needed
    monkeypatch.undo()
    assert not os.path.exists(os.path.join(save_dir, "iter_0000002"))  # the partial save is gone
    assert read_latest(save_dir) == 1 and load_checkpoint(save_dir, "actor", **trainer).rollout_id == 1


def test_another_write_failure_is_not_called_a_full_device(tmp_path, trainer, monkeypatch):
    save_dir = str(tmp_path / "ckpt")

    def read_only(self, path, mode):
        raise PermissionError(f"{path} is read-only")

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", read_only)
    with pytest.raises(BaseException, match="read-only") as caught:
        save_checkpoint(save_dir, 1, "actor", **trainer)
    assert not isinstance(caught.value, CheckpointSpaceError)
    assert not os.path.exists(os.path.join(save_dir, "iter_0000001"))


def test_too_little_room_is_warned_about_before_and_after_a_save(tmp_path, trainer, monkeypatch, caplog):
    save_dir = str(tmp_path / "ckpt")
    path = save_checkpoint(save_dir, 1, "actor", **trainer)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    write_latest(save_dir, 1)
    free = shutil.disk_usage(save_dir).free
    monkeypatch.setattr(checkpoint_space.shutil, "disk_usage", lambda p: Usage(free, 0, size // 2))
    with caplog.at_level("WARNING", logger="miles.backends.fsdp_utils.checkpoint_space"):
        save_checkpoint(save_dir, 2, "actor", save_flag="--critic-save", **trainer)  # the real disk has room
    before, after = [r.getMessage() for r in caplog.records if r.name == checkpoint_space.logger.name]
    assert before.startswith(f"--critic-save {save_dir}: its device has") and "saving iteration 2 needs about" in before
    assert "the save will likely fail" in before
    assert f"iteration 2 took {checkpoint_space.human(size)}" in after and "the next save will likely not fit" in after


def test_a_full_device_under_save_hf_is_named_and_other_failures_pass_through(tmp_path, monkeypatch):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 1000)
    full = checkpoint_space.export_space_error(
        OSError(errno.ENOSPC, "No space left on device"), "--save-hf", str(folder), 5000
    )
    assert str(full).startswith(f"no space left on the device of --save-hf {folder} while writing the trained weights")
    assert "the folder now holds 1.0 KB" in str(full) and "the checkpoints of --save are untouched" in str(full)
    assert checkpoint_space.export_space_error(ValueError("bad config"), "--save-hf", str(folder), 5000) is None
    monkeypatch.setattr(checkpoint_space.shutil, "disk_usage", lambda path: Usage(10**9, 10**9, 10))
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert isinstance(checkpoint_space.export_space_error(torch_error, "--save-hf", str(folder), 5000), OSError)


SCRIPT = textwrap.dedent(
    """
    import sys
    from datetime import timedelta
    from miles.backends.fsdp_utils.checkpoint import load_checkpoint, save_checkpoint, write_latest
    from miles.utils.distributed import find_free_port, init_process_group
    from tests.fast.backends.fsdp_utils.fsdp_workers import build_trainer

    init_process_group(0, 1, "127.0.0.1", find_free_port(), "cpu", timeout=timedelta(seconds=60))
    model, optimizer, scheduler = build_trainer(0)
    trainer = {"model": model, "optimizer": optimizer, "lr_scheduler": scheduler}
    save_checkpoint(sys.argv[1], 1, "actor", **trainer)
    write_latest(sys.argv[1], 1)
    try:
        save_checkpoint(sys.argv[1], 2, "actor", **trainer)
    except OSError as exc:
        print("ERROR", exc)
    print("LOADED", load_checkpoint(sys.argv[1], "actor", **trainer).rollout_id)
    """
)


@pytest.mark.standard
def test_a_real_tiny_filesystem_fills(tmp_path, trainer):
    """The same on a tmpfs of 1.5 checkpoints mounted in a user namespace (skipped where unshare is not allowed)."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-Urm", "true"]).returncode != 0:
        pytest.skip("unshare -Urm is not allowed here")
    path = save_checkpoint(str(tmp_path / "sized"), 1, "actor", **trainer)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    mount, script = tmp_path / "mnt", tmp_path / "fill.py"
    mount.mkdir()
    script.write_text(SCRIPT)
    command = f"mount -t tmpfs -o size={size * 3 // 2 // 1024}k tmpfs {mount} && {sys.executable} {script} {mount}/ckpt"
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", command], capture_output=True, text=True, env=env, timeout=120
    )
    assert f"ERROR no space left on the device of --save {mount}/ckpt while saving iteration 2" in done.stdout, done
    assert "LOADED 1" in done.stdout, done
