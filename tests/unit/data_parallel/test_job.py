"""Chapter 3's join_job: a process reads who it is from torchrun's environment and joins."""

import os
import subprocess
import sys

from dmlbook.launch import free_port

READ_AND_JOIN = """
import torch.distributed as dist
from dmlbook.data_parallel.job import join_job
where = join_job()
print(where["rank"], where["local_rank"], where["world_size"], where["node"], where["store"],
      dist.get_rank(), dist.get_world_size())
dist.destroy_process_group()
"""


def test_join_job_reads_torchruns_environment_and_joins_the_group():
    port = free_port()
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", GROUP_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", READ_AND_JOIN], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "0", "1", "0", f"127.0.0.1:{port}", "0", "1"]
