#!/usr/bin/env bash
# Start one piece of a site's Dask cluster from its spec (a shell file of variables):
#   bash infra/dask/site.sh infra/dask/onprem.env scheduler   # once, on the scheduler host
#   bash infra/dask/site.sh infra/dask/onprem.env worker      # on every worker host
# Every host needs quantloop installed from the same commit as the Prefect workers
# (`bash infra/install.sh`): Dask workers run quantloop's node code by reference.
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 SPEC.env scheduler|worker" >&2; exit 2; }
# shellcheck source=/dev/null
source "$1"
dask=${DASK:-dask}

case "$2" in
  scheduler)
    exec "$dask" scheduler --host "${SCHEDULER_BIND:-0.0.0.0}" --port "$SCHEDULER_PORT" \
      --dashboard-address ":$DASHBOARD_PORT"
    ;;
  worker)
    # One process per core, one thread each: feature nodes are NumPy-heavy Python
    # and hold the GIL, so threads would only queue behind each other. The preload
    # imports the node code as a worker starts (blocks/site.py WORKER_PRELOAD), not
    # in the middle of a run's first batch. RESOURCES (e.g. GPU=1) is what a GPU host
    # declares: training goes to a worker that has it (flows/train.py).
    exec "$dask" worker "tcp://$SCHEDULER_HOST:$SCHEDULER_PORT" \
      --name "$SITE-$(hostname -s)" \
      --nworkers "$NWORKERS" --nthreads 1 --memory-limit "$MEMORY_LIMIT" \
      --local-directory "$LOCAL_DIR" \
      --preload quantloop.tasks.engine.batch --preload quantloop.tasks.research.features \
      ${RESOURCES:+--resources "$RESOURCES"}
    ;;
  *)
    echo "unknown role $2 (scheduler or worker)" >&2
    exit 2
    ;;
esac
