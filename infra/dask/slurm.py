"""Site "hpc": a Dask cluster on SLURM through dask-jobqueue (a documented snippet, not
run by the tests; `pip install dask-jobqueue` on the login host).

Run it on the login host; it prints the scheduler address to put in the Site block,
and keeps the cluster until Ctrl-C:

    python infra/dask/slurm.py
    # Site(name="hpc", scheduler_address="tcp://login01:8786",
    #      storage_root="/lustre/desk/quantloop/store", gpus=4, cost_per_hour=12.0)
"""

import time

from dask_jobqueue import SLURMCluster

cluster = SLURMCluster(
    queue="cpu",
    cores=16,
    processes=16,  # one single-threaded process per core: feature nodes hold the GIL
    memory="96GB",
    walltime="08:00:00",
    scheduler_options={"port": 8786, "dashboard_address": ":8787"},
    # the node code, imported as each worker starts (blocks/site.py WORKER_PRELOAD)
    worker_extra_args=[
        "--preload",
        "quantloop.tasks.engine.batch",
        "--preload",
        "quantloop.tasks.research.features",
    ],
    job_script_prologue=["source /opt/quantloop/.venv/bin/activate"],
)
cluster.scale(jobs=4)
# GPU nodes: a second cluster object cannot share the scheduler; submit GPU workers as
# their own jobs that join it:
#   sbatch --gres=gpu:1 --wrap "dask worker tcp://login01:8786 --nworkers 1 \
#       --nthreads 1 --resources GPU=1"
print(cluster.scheduler_address)
while True:
    time.sleep(3600)
