"""The faults a shared cluster brings, each in real jobs on small models, with a bound on
how long the job takes to end (docs/faults.md has the table):

- two jobs on one --save-dir: the second is refused in one line before it trains; a folder
  whose job crashed is free again;
- preemption: SIGTERM (and --save-signal) makes every rank finish its step and save it, and
  the resume is bit-exact; SIGINT without a folder ends the job at once, one line;
- the parameter server: a NaN ends the job in seconds with its one line; a frozen ASP
  worker is dropped and the others finish, whatever MINIDP_TIMEOUT is;
- a manifest that points outside its folder, or at a FIFO, is refused in one line;
- one line, printed once, for a frozen rank under pp and hybrid and for a failed save;
  an aborted job leaves no shared-memory file behind;
- pp on one rank writes its final --json record.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from test_faults import BOUND_S, TIMEOUT_S, finish, launch, leaked_shm, rank_pids, wait_for_step

MLP = ["--model", "mlp", "--hidden", "16", "--batch-size", "8", "--eval-batches", "1"]
GPT = ["--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--block-size", "8"]
GPT += ["--batch-size", "8", "--eval-batches", "1", "--sample-tokens", "0"]


def run(nprocs: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "minidp", *args]
    if nprocs > 1:
        command = ["mpiexec", "-n", str(nprocs), *command]
    env = dict(os.environ, MINIDP_TIMEOUT=str(TIMEOUT_S), PYTHONUNBUFFERED="1")
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def one_line(err: str, *words: str) -> str:
    """The job's stderr is exactly one line, holding one of `words`, and no traceback."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and any(w in lines[0] for w in words), err
    assert "Traceback" not in err and "Warning" not in err, err
    return lines[0]


def records(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


# ---- one job at a time in a save folder -----------------------------------------------------
@pytest.mark.timeout(90)
def test_a_second_job_on_the_same_save_dir_is_refused_and_a_crashed_ones_folder_is_free(
    tmp_path,
):
    began = time.time()
    folder, logs = tmp_path / "run", tmp_path / "logs"
    first = launch(2, *MLP, "--steps", "100000", "--save-dir", str(folder), "--save-every",
                   "1000", "--log-dir", str(logs))  # fmt: skip
    wait_for_step(logs / "rank1.log", 3, first)
    start = time.monotonic()
    second = run(2, *MLP, "--steps", "10", "--save-dir", str(folder))
    assert second.returncode == 2 and time.monotonic() - start < 30, second.stderr
    line = one_line(second.stderr, f"--save-dir {folder} is in use by another job (process")
    assert "overwrite each other's checkpoints" in line and "step " not in second.stdout
    os.killpg(first.pid, signal.SIGKILL)  # the first job crashes: its lock goes with it
    finish(first, 30)
    third = run(1, *MLP, "--steps", "3", "--save-dir", str(folder))
    assert third.returncode == 0, third.stderr
    assert (folder / "step_000003" / "manifest.json").exists()
    leaked_shm(began)  # SIGKILL from outside: MPICH's file is left (docs/faults.md)


def test_the_folder_lock_as_a_piece(tmp_path, monkeypatch, capsys):
    """checkpoint.folder_lock in a script: held, refused while held, free after; on a
    filesystem that keeps no locks, a warning and no lock rather than no save."""
    import errno
    import fcntl

    from minidp import comm
    from minidp.parallel import checkpoint

    alone = comm.world().split(comm.world().rank)
    with checkpoint.folder_lock(str(tmp_path), alone):
        with pytest.raises(checkpoint.FolderInUse, match=f"process {os.getpid()} on "):
            with checkpoint.folder_lock(str(tmp_path), alone):
                pass
    with checkpoint.folder_lock(str(tmp_path), alone):  # released: taken again
        pass

    def no_locks(fd, operation):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with checkpoint.folder_lock(str(tmp_path), alone):
        pass
    assert "this filesystem keeps no locks" in capsys.readouterr().err


# ---- preemption ----------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_sigterm_saves_the_step_reached_and_the_resume_is_bit_exact(tmp_path):
    flags = [*MLP, "--steps", "3000", "--dtype", "float64", "--log-every", "100"]
    folder, logs = tmp_path / "run", tmp_path / "logs"
    job = launch(2, *flags, "--save-dir", str(folder), "--save-every", "100000",
                 "--log-dir", str(logs), "--json", str(tmp_path / "a.json"))  # fmt: skip
    wait_for_step(logs / "rank1.log", 20, job)
    # to mpiexec, which forwards it to every rank, and to the ranks themselves, as a
    # scheduler that signals every process does: one warning, not a second "stop now"
    for pid in [job.pid, *rank_pids(job).values()]:
        os.kill(pid, signal.SIGTERM)
    out, err, seconds = finish(job, 30)
    assert job.returncode == 128 + signal.SIGTERM and seconds < 10, (job.returncode, err)
    line = one_line(err, "minidp: stopped: SIGTERM after ")
    done = int(line.split("after ")[1].split(" of")[0])
    assert 20 < done < 3000 and f"saved {folder}/step_{done:06d}" in line, line
    assert records(tmp_path / "a.json")[-1] == {
        "stopped_by": "SIGTERM", "steps_done": done, "checkpoint": f"{folder}/step_{done:06d}"
    }  # fmt: skip
    resumed = run(2, *flags, "--resume", str(folder), "--json", str(tmp_path / "b.json"))
    assert resumed.returncode == 0 and f"resumed from {folder}/step_{done:06d}" in resumed.stdout
    whole = run(2, *flags, "--json", str(tmp_path / "c.json"))
    assert whole.returncode == 0, whole.stderr
    final, want = records(tmp_path / "b.json")[-1], records(tmp_path / "c.json")[-1]
    assert final["param_l2"] == want["param_l2"] and final["final_loss"] == want["final_loss"]


@pytest.mark.timeout(60)
def test_sigint_without_a_save_dir_ends_the_job_at_once_in_one_line(tmp_path):
    began = time.time()
    job = launch(2, *GPT, "--steps", "100000", "--log-every", "1", "--log-dir", str(tmp_path))
    wait_for_step(tmp_path / "rank1.log", 3, job)
    job.send_signal(signal.SIGINT)
    _, err, seconds = finish(job, 30)
    assert job.returncode != 0 and seconds < 5, (seconds, err)
    one_line(err, "minidp: stopped: SIGINT at step ")
    assert "nothing is saved without --save-dir" in err
    assert leaked_shm(began) == []  # the aborting ranks removed their job's segment


@pytest.mark.timeout(90)
def test_the_save_signal_stops_the_parameter_server_saved_and_it_resumes(tmp_path):
    flags = [*MLP, "--strategy", "ps", "--steps", "5000", "--log-every", "100"]
    folder, logs = tmp_path / "run", tmp_path / "logs"
    job = launch(3, *flags, "--save-dir", str(folder), "--save-signal", "SIGUSR1",
                 "--log-dir", str(logs))  # fmt: skip
    wait_for_step(logs / "rank2.log", 20, job)  # the server too
    job.send_signal(signal.SIGUSR1)
    _, err, seconds = finish(job, 30)
    assert job.returncode == 128 + signal.SIGUSR1 and seconds < 10, (job.returncode, err)
    line = one_line(err, "minidp: stopped: SIGUSR1 after ")
    done = int(line.split("after ")[1].split(" of")[0])
    resumed = run(3, *flags, "--resume", str(folder))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {folder}/step_{done:06d} at step {done}" in resumed.stdout


# ---- the parameter server ------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("consistency", ["bsp", "asp"])
def test_a_nan_under_the_parameter_server_ends_the_job_in_seconds_in_one_line(consistency):
    began = time.time()
    job = launch(3, *GPT, "--strategy", "ps", "--consistency", consistency, "--lr", "1e6",
                 "--steps", "200", "--log-every", "1")  # fmt: skip
    _, err, seconds = finish(job, 40)
    assert job.returncode != 0, err
    one_line(err, "minidp: error: loss is nan at step ")
    assert leaked_shm(began) == []


@pytest.mark.timeout(90)
def test_a_frozen_asp_worker_is_dropped_and_the_job_finishes_past_minidp_timeout(tmp_path):
    """--ps-timeout 6 > MINIDP_TIMEOUT 5: after the drop the first server listens 6 s for
    the dropped worker's goodbye, and the live ranks' next collective waits that long."""
    began = time.time()
    flags = [*MLP, "--strategy", "ps", "--consistency", "asp", "--ps-timeout", "6"]
    job = launch(3, *flags, "--steps", "3000", "--log-every", "1", "--log-dir", str(tmp_path),
                 "--json", str(tmp_path / "r.json"))  # fmt: skip
    wait_for_step(tmp_path / "rank1.log", 20, job)
    os.kill(rank_pids(job)[1], signal.SIGSTOP)  # worker 1 (rank 2 serves)
    out, err, _ = finish(job, 60)
    assert job.returncode == 0, err
    assert "dropped worker(s) 1 never ended" in out
    final = records(tmp_path / "r.json")[-1]
    assert final["dropped_workers"] == [1] and final["workers_not_ended"] == [1]
    assert leaked_shm(began) == []  # rank 0's abort removed the job's segment


# ---- manifests -----------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_manifest_that_points_outside_its_folder_or_at_a_fifo_is_refused_in_one_line(
    tmp_path,
):
    folder = tmp_path / "run"
    assert (
        run(1, *MLP, "--steps", "4", "--save-dir", str(folder), "--save-every", "2").returncode == 0
    )
    step = folder / "step_000002"
    manifest_path = step / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    elsewhere = tmp_path / "elsewhere.safetensors"  # the very bytes: the checksum matches
    shutil.copy(step / manifest["shards"][0]["file"], elsewhere)
    for name in (str(elsewhere), "../../elsewhere.safetensors", ".."):
        manifest["shards"][0]["file"] = name
        manifest_path.write_text(json.dumps(manifest))
        refused = run(1, *MLP, "--steps", "4", "--resume", str(step))
        assert refused.returncode == 2, refused.stderr
        one_line(refused.stderr, f"shard 0's file {name!r} is not a plain file name")
    os.mkfifo(step / "fifo")
    manifest["shards"][0]["file"] = "fifo"
    manifest_path.write_text(json.dumps(manifest))
    start = time.monotonic()
    refused = run(1, *MLP, "--steps", "4", "--resume", str(step), timeout=30)
    assert refused.returncode == 2 and time.monotonic() - start < 15, refused.stderr
    one_line(refused.stderr, f"{step}/fifo is not a regular file")


# ---- one line, once --------------------------------------------------------------------------
FROZEN = {
    "pp": (2, ["--strategy", "pp"]),
    "hybrid": (4, ["--strategy", "hybrid", "--dp", "2", "--tp", "2"]),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", FROZEN)
def test_a_frozen_rank_under_pp_and_hybrid_is_one_line_printed_once(strategy, tmp_path):
    began = time.time()
    nprocs, flags = FROZEN[strategy]
    job = launch(nprocs, *flags, *GPT, "--steps", "100000", "--log-every", "1",
                 "--log-dir", str(tmp_path))  # fmt: skip
    wait_for_step(tmp_path / "rank1.log", 3, job)
    os.kill(rank_pids(job)[1], signal.SIGSTOP)
    _, err, seconds = finish(job, BOUND_S + 10)
    assert job.returncode != 0 and seconds < BOUND_S, (seconds, err)
    # the watchdog, or the rendezvous's deadline, or the pipeline's wait, names rank 1
    one_line(err, "(world 1)", "heard nothing from rank 1")
    assert leaked_shm(began) == []


@pytest.mark.timeout(60)
def test_a_ranks_own_error_is_what_is_printed_not_its_neighbours_timeout():
    """Rank 3 fails 2.5 s in while ranks 0-2 wait for it in an allreduce (deadline 5 s):
    its traceback ends the job, before any neighbour would name it as silent."""
    code = (
        "import time, numpy as np\n"
        "from minidp import comm\n"
        "from minidp.comm.abort import end_job\n"
        "g = comm.world()\n"
        "try:\n"
        "    if g.rank == 3:\n"
        "        time.sleep(2.5)\n"
        "        raise ValueError('a bug of rank 3 alone')\n"
        "    comm.allreduce(np.ones(4), group=g)\n"
        "except BaseException as error:\n"
        "    end_job(error)\n"
    )
    env = dict(os.environ, MINIDP_TIMEOUT=str(TIMEOUT_S))
    job = subprocess.run(["mpiexec", "-n", "4", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert job.returncode != 0 and "ValueError: a bug of rank 3 alone" in job.stderr, job.stderr
    assert job.stderr.count("Root cause") == 1 and "heard nothing" not in job.stderr, job.stderr


@pytest.mark.timeout(60)
def test_a_failed_save_is_one_line_and_the_job_ends(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "step_000002").write_text("a file where the save makes its folder")
    failed = run(2, *MLP, "--steps", "4", "--save-dir", str(folder), "--save-every", "2")
    assert failed.returncode == 1, failed.stderr
    one_line(failed.stderr, "minidp: error: the checkpoint of step 2 was not saved: rank 0 ")


def test_pp_on_one_rank_writes_its_final_record(tmp_path):
    done = run(1, *GPT, "--strategy", "pp", "--steps", "3", "--json", str(tmp_path / "r.json"))
    assert done.returncode == 0, done.stderr
    final = records(tmp_path / "r.json")[-1]
    assert final["steps"] == 3 and final["predicted_step_s"] > 0
