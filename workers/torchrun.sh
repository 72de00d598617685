#!/usr/bin/env bash
# workers/torchrun.sh -- one host of a multi-host `pipeq launch` run under torchrun
# (python -m torch.distributed.run).
#
# Usage: workers/torchrun.sh NODE_RANK MASTER_ADDR [extra `pipeq launch` args...]
#
# torchrun starts NPROC_PER_NODE worker processes on this host; every worker is one pipeq node
# (pipeq reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK from torchrun's
# environment, so no pipeq multi-host flags are passed). Worker rank 0 runs the driver and
# writes the outputs; torchrun's agent on host A hosts the rendezvous store. In all there are
# NNODES x NPROC_PER_NODE pipeq nodes: at most the job's number of stages.
#
# Every pipeq node needs the job's secret, the same on every host: export PIPEQ_SECRET (torchrun's
# workers inherit its environment) or set SECRET_FILE (a file only its owner may read, passed to
# every worker as --secret-file). Two hosts, one pipeq node each: host A (node 0) and host B
# (node 1), in either order:
#
#   host A$ python -m pipeq secret --out ~/job.secret    # mode 0600; copy it to host B (scp -p)
#   host A$ export PIPEQ_SECRET=$(cat ~/job.secret)      # (or SECRET_FILE=~/job.secret below)
#   host A$ workers/torchrun.sh 0 hostA --steps 200 --out runs/digits
#   host B$ export PIPEQ_SECRET=$(cat ~/job.secret)
#   host B$ workers/torchrun.sh 1 hostA --steps 200 --out runs/digits
#
# which run, from the repository root:
#
#   host A$ python -m torch.distributed.run --nnodes 2 --node-rank 0 --nproc-per-node 1 \
#               --master-addr hostA --master-port 29500 \
#               -m pipeq launch examples/digits.toml --steps 200 --out runs/digits
#   host B$ python -m torch.distributed.run --nnodes 2 --node-rank 1 --nproc-per-node 1 \
#               --master-addr hostA --master-port 29500 \
#               -m pipeq launch examples/digits.toml --steps 200 --out runs/digits
#
# Two pipeq nodes on one host (two processes over loopback, splitting its CPU cores):
#
#   PIPEQ_SECRET=$(python -m pipeq secret) NNODES=1 NPROC_PER_NODE=2 \
#       workers/torchrun.sh 0 127.0.0.1 --steps 200
#
# Tensor parallelism (tensor_parallel = T and tp_plan in the job, or --tensor-parallel T after the
# script's arguments): each pipeq node runs its stages' T shards on its own host, a GPU each out of
# its share of the host's (GPUs / NPROC_PER_NODE; so NPROC_PER_NODE x T x stages per node <= the
# host's GPUs), or its share of the CPU cores.
#
# A run that survives a lost node: MAX_RESTARTS=K on every host. pipeq's driver (node 0) gets
# --max-restarts K (REJOIN_TIMEOUT, MIN_NODES: pipeq's --rejoin-timeout, --min-nodes), and every host
# but host 0 also gets torchrun's own --max-restarts K: when this host's pipeq node dies (its host
# alive), torchrun starts it again, and it rejoins the run within the rejoin timeout. A host that
# dies is replaced by running this script with its NODE_RANK on another host (torchrun's static
# rendezvous gives it the same rank); or, with MIN_NODES, node 0 re-places its stages on the
# hosts left. Host 0 gets no torchrun restarts: a torchrun restart of its workers would restart
# the driver, which is the run (pipeq restarts the stages by itself instead).
#
#   host A$ MAX_RESTARTS=3 MIN_NODES=1 workers/torchrun.sh 0 hostA --steps 200 --out runs/digits
#   host B$ MAX_RESTARTS=3 workers/torchrun.sh 1 hostA --steps 200 --out runs/digits
#
# torchrun's other elastic flags are not used: --nnodes MIN:MAX needs its dynamic (c10d) rendezvous,
# where any change of membership restarts every worker, node 0's driver included; pipeq keeps the
# driver and its rendezvous store running and waits for or re-places the lost node itself
# (MIN_NODES is the MIN of MIN:MAX; a run never grows past its --nnodes).
#
# Without a secret the script refuses to start: nobody without it can join the run.
#
# Environment:
#   PIPEQ_SECRET=SECRET       the job's secret (at least 32 characters), inherited by every worker;
#                             required unless SECRET_FILE is set
#   SECRET_FILE=PATH          the secret in a file (mode 0600), passed as --secret-file instead
# and optionally:
#   NNODES=2                  number of hosts (torchrun --nnodes)
#   NPROC_PER_NODE=1          pipeq nodes (worker processes) per host
#   MASTER_PORT=29500         TCP port of the rendezvous store on host A
#   JOB=examples/digits.toml  the job file, relative to WORKDIR
#   BIND=ADDR_OR_IFACE        passed as pipeq's --bind (default: the address routing to MASTER_ADDR)
#   PYTHON=python             the interpreter that has torch and pipeq installed
#   WORKDIR=<repo root>       where to run (the job's importable names resolve from there)
#   MAX_RESTARTS=K            pipeq's --max-restarts K, and torchrun's on every host but host 0
#   REJOIN_TIMEOUT=SECONDS    pipeq's --rejoin-timeout: how long a lost node has to rejoin (default 60)
#   MIN_NODES=N               pipeq's --min-nodes: re-place a lost node's stages while N nodes remain
set -euo pipefail

prog=${0##*/}

usage() {
    cat >&2 <<USAGE
usage: $prog NODE_RANK MASTER_ADDR [extra pipeq launch args...]
  host A: $prog 0 hostA --steps 200
  host B: $prog 1 hostA --steps 200
  one host, 2 processes: NNODES=1 NPROC_PER_NODE=2 $prog 0 127.0.0.1
  the job's secret, the same on every host: PIPEQ_SECRET exported (make one with
       \`python -m pipeq secret\`) or SECRET_FILE=job.secret (mode 0600)
  env: NNODES (2), NPROC_PER_NODE (1), MASTER_PORT (29500), JOB (examples/digits.toml), BIND,
       PYTHON (python), WORKDIR (the repository root), MAX_RESTARTS, REJOIN_TIMEOUT, MIN_NODES;
       see the header of $0
USAGE
}

die() {
    echo "$prog: $*" >&2
    usage
    exit 2
}

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    usage
    exit 0
fi
[[ $# -ge 1 ]] || die "missing NODE_RANK (this host's rank: 0 on the host that runs the driver)"
[[ $# -ge 2 ]] || die "missing MASTER_ADDR (the address of host 0)"
NODE_RANK=$1
MASTER_ADDR=$2
shift 2
[[ $NODE_RANK =~ ^[0-9]+$ ]] || die "NODE_RANK must be a number, got '$NODE_RANK'"
[[ -n $MASTER_ADDR ]] || die "MASTER_ADDR is empty"

NNODES=${NNODES:-2}
NPROC_PER_NODE=${NPROC_PER_NODE:-1}
MASTER_PORT=${MASTER_PORT:-29500}
JOB=${JOB:-examples/digits.toml}
PYTHON=${PYTHON:-python}

secret=()
if [[ -n ${SECRET_FILE:-} ]]; then
    [[ $SECRET_FILE == /* ]] || SECRET_FILE=$PWD/$SECRET_FILE  # before the cd below
    [[ -f $SECRET_FILE ]] || die "SECRET_FILE '$SECRET_FILE' not found"
    secret=(--secret-file "$SECRET_FILE")
fi

cd "${WORKDIR:-$(dirname "${BASH_SOURCE[0]}")/..}"
[[ -f $JOB ]] || die "job file '$JOB' not found in $PWD"
[[ ${#secret[@]} -gt 0 || -n ${PIPEQ_SECRET:-} ]] ||
    die "no job secret: export PIPEQ_SECRET (or set SECRET_FILE), the same on every host"

bind=()
if [[ -n ${BIND:-} ]]; then
    bind=(--bind "$BIND")
fi

elastic=()  # pipeq's restarts: the same on every node (only node 0's driver acts on them)
[[ -z ${MAX_RESTARTS:-} ]] || elastic+=(--max-restarts "$MAX_RESTARTS")
[[ -z ${REJOIN_TIMEOUT:-} ]] || elastic+=(--rejoin-timeout "$REJOIN_TIMEOUT")
[[ -z ${MIN_NODES:-} ]] || elastic+=(--min-nodes "$MIN_NODES")
restarts=()  # torchrun's: this host's workers started again when one dies (not the driver's host)
if [[ -n ${MAX_RESTARTS:-} && $NODE_RANK != 0 ]]; then
    restarts=(--max-restarts "$MAX_RESTARTS")
fi

cmd=("$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK"
     --nproc-per-node "$NPROC_PER_NODE" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
     ${restarts[@]+"${restarts[@]}"} -m pipeq launch "$JOB" ${secret[@]+"${secret[@]}"}
     ${bind[@]+"${bind[@]}"} ${elastic[@]+"${elastic[@]}"} "$@")
echo "$prog: host $NODE_RANK of $NNODES in $PWD:$(printf ' %q' "${cmd[@]}")" >&2
exec "${cmd[@]}"
