#!/usr/bin/env bash
# Submit flexorch train to a Ray cluster as a Ray job (run from the repository root).
#
# Once per cluster (Ray 2.60 turns on token authentication when a head starts):
#   ray get-auth-token --generate          # writes ~/.ray/auth_token; copy it to every node and client
#   ray start --head --dashboard-host=0.0.0.0                      # on the head
#   ray start --address=HEAD_IP:6379                              # on each worker node (joins grow the run)
# Then, from any machine with the token:
#   RAY_AUTH_MODE=token examples/submit_cluster.sh http://HEAD_IP:8265
set -euo pipefail
ADDRESS="${1:-http://127.0.0.1:8265}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
# --working-dir ships this checkout to the cluster; the job's Python needs torch and ray (pip install -e . on
# every node, or add: --runtime-env-json '{"pip": ["torch==2.13.0", "mip==2.0"]}')
# `ray job stop` sends SIGTERM: flexorch finishes the step in flight, writes a checkpoint and exits 0; Ray SIGKILLs
# the job RAY_JOB_STOP_WAIT_TIME_S after the SIGTERM (3 s by default), so give it the time a step and a checkpoint take
# [checkpoint] storage in the run file is an S3 prefix: the driver and every worker write there, with the credentials
# of the nodes' environment, or the job's: add "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY" (and "AWS_DEFAULT_REGION",
# "AWS_ENDPOINT_URL" for an S3-compatible server) to env_vars below, or set them on every node
ray job submit --address "$ADDRESS" --working-dir . \
    --runtime-env-json '{"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "300"}}' -- \
    python -m flexorch.cli.main train --config examples/train_cluster.toml "${@:2}"
# Follow it:  ray job logs --address "$ADDRESS" --follow <job id>     Status: ray job status --address ...
# Stop it:    ray job stop --address "$ADDRESS" <job id>   (then submit again with --resume to continue)
