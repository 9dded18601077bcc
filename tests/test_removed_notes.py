"""A stale temporary of a dead writer, removed during --resume=<folder> with several processes: every rank tries, one
removes it, and that rank says so once on its console (rank 0's log gets it too, for the record); rank 0 says its own
removals with the other notes."""
import json
import os
import socket
import subprocess
import sys
import textwrap

from _shards import ROOT

# Each rank: join a 2-process gloo group, then load_checkpoint the folder. Rank 0 first waits until the temporary is
# gone, so rank 1 is the one that removes it (which rank wins the race otherwise varies from run to run).
RANK = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    import torch.distributed as dist
    import harness
    folder, temp = Path(sys.argv[2]), Path(sys.argv[3])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    if rank == 0:
        remove = harness.remove_stale_temporaries
        def after_rank_1(folder):
            deadline = time.time() + 60                  # a hang guard
            while temp.exists() and time.time() < deadline:
                time.sleep(0.05)
            return remove(folder)
        harness.remove_stale_temporaries = after_rank_1
    state = harness.load_checkpoint(str(folder), rank, 2)
    print("RESULT " + json.dumps({"notes": state["notes"], "log_notes": state["log_notes"]}), flush=True)
    dist.destroy_process_group()
""")


def dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_the_rank_that_removes_a_dead_writers_temporary_says_so_once(tmp_path):
    import torch
    import harness
    import train_gpt as tg
    hp = tg.parse_args([f"--log_dir={tmp_path}"])
    whole = {key: 0 for key in harness.STATE_KEYS}
    for rank in range(2):
        harness.Checkpointer(hp, "run", rank, 2, {}, lambda line: None, "code").save(
            {**whole, "step": 3, "model": {"w": torch.zeros(4)}})
    folder = tmp_path / "run"
    temp = folder / f"state_step000006_rank1.pt.tmp{dead_pid()}"
    temp.write_bytes(b"cut short")
    assert harness.TEMPORARY_NAME.fullmatch(temp.name)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(ROOT), str(folder), str(temp)],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES=""),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    results = [json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
               for out, _ in outs]
    said = f"note: removed {temp}, the temporary file of a write that was cut short"
    consoles = [line for out, _ in outs for line in out.splitlines() if line.startswith("note:")]
    consoles += results[0]["notes"]                # rank 0's notes: what begin_run prints and logs
    assert consoles == [f"{said} (by rank 1)"], consoles
    assert results[0]["log_notes"] == [f"{said} (by rank 1)"] and results[1]["notes"] == []
    assert not temp.exists()
