import json
import socket
import subprocess
import sys
from pathlib import Path

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_zero2_under_torchrun_on_cpu(tiny_tree, write_config, child_env, tmp_path):
    tree = tiny_tree("zero2", train={"zero_stage": 2, "micro_batch_size": 2})
    config = write_config(tree, tmp_path / "zero2.yaml")
    env = {**child_env, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
        "-m", "geofm.cli", "pretrain", "--config", str(config),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]

    run_dir = Path(tree["run"]["output_dir"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # 24 samples per epoch / (2 images x 2 processes) = 6 steps per epoch, 2 epochs.
    assert [r["step"] for r in records] == list(range(1, 13))
    last = run_dir / "checkpoints/last"
    shards = sorted(p.name for p in last.glob("*optim_states.pt"))
    assert shards == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    state = torch.load(last / "mp_rank_00_model_states.pt", weights_only=False)
    assert state["ds_config"]["zero_optimization"]["stage"] == 2 and state["dp_world_size"] == 2
    assert (run_dir / "backbone.safetensors").exists()
