"""A checkpoint directory on its own small file system that fills while an asynchronous save
writes: one line, not orbax's tracebacks from every writer thread and in-flight write, and
nothing lost (the last good checkpoint restores, and the rerun's losses are an uninterrupted
run's)."""

import os
import subprocess

import pytest

from conftest import tiny_config


def _config(workdir, ckpt_dir):
    return tiny_config(**{"workdir": str(workdir), "checkpoint.dir": str(ckpt_dir),
                          "checkpoint.every": 2, "checkpoint.async_save": True,
                          "train.steps": 8, "train.log_every": 1})


def _losses(workdir):
    from hetjax.metrics import read_metrics

    return [r["loss"] for r in read_metrics(os.path.join(workdir, "metrics.jsonl"))]


@pytest.mark.root
@pytest.mark.slow  # three small trainings; test_a_full_disk_is_one_error... patches it fast
def test_a_full_checkpoint_disk_under_async_saving_is_one_line_and_loses_nothing(tmp_path,
                                                                                 capfd):
    from hetjax.errors import HetjaxError
    from hetjax.train import Trainer

    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"could not mount a tmpfs: {mounted.stderr.strip()}")
    try:
        Trainer(_config(tmp_path / "straight", tmp_path / "straight_ckpt"), quiet=True).train()
        reference = _losses(tmp_path / "straight")

        trainer = Trainer(_config(tmp_path / "run", disk / "ckpt"), quiet=True)

        def fill(info):  # after checkpoint 4 is whole, leave less than a checkpoint free
            if info.step == 5:
                trainer.checkpointer.wait()
                stat = os.statvfs(disk)
                fd = os.open(disk / "filler", os.O_CREAT | os.O_WRONLY)
                os.posix_fallocate(fd, 0, stat.f_bavail * stat.f_frsize - 200_000)
                os.close(fd)

        trainer.add_hook(fill)
        capfd.readouterr()
        with pytest.raises(HetjaxError) as e:
            trainer.train()
        err = capfd.readouterr().err
        assert str(e.value) == (
            f"training stopped: {disk}/ckpt: No space left on device; fix: free space on the "
            f"disk holding {disk}/ckpt (or choose a path on another disk); then rerun the same "
            f"command to resume (checkpoint 4 in {disk}/ckpt is kept)")
        assert "Traceback" not in err and "RESOURCE_EXHAUSTED" not in err, err[-3000:]
        trainer.checkpointer.close()
        os.remove(disk / "filler")
        again = Trainer(_config(tmp_path / "run", disk / "ckpt"), quiet=True)
        assert again.train()["resumed_from"] == 4
        assert _losses(tmp_path / "run") == reference
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
