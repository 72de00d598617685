#!/usr/bin/env bash
# workers/local.sh -- one node of a multi-host `pipeq launch` run, with pipeq's own flags.
#
# Usage: workers/local.sh NODE_RANK MASTER_ADDR [extra `pipeq launch` args...]
#
# Start it once on every host, with that host's NODE_RANK, the same MASTER_ADDR (node 0's
# address: node 0 runs the driver and hosts the rendezvous store there), the same job secret and
# the same extra arguments. Order does not matter. Only node 0 writes outputs (--out, relative to
# node 0's repository root). A 2-node run of examples/digits.toml (3 stages: node 0 runs stage 0,
# node 1 runs stages 1 and 2) on host A (node 0) and host B (node 1):
#
#   host A$ python -m pipeq secret --out ~/job.secret    # mode 0600; copy it to host B (scp -p)
#   host A$ SECRET_FILE=~/job.secret workers/local.sh 0 hostA --steps 200 --out runs/digits
#   host B$ SECRET_FILE=~/job.secret workers/local.sh 1 hostA --steps 200 --out runs/digits
#
# which run, from the repository root:
#
#   host A$ python -m pipeq launch examples/digits.toml --nnodes 2 --node-rank 0 \
#               --master-addr hostA --master-port 29500 --secret-file ~/job.secret \
#               --steps 200 --out runs/digits
#   host B$ python -m pipeq launch examples/digits.toml --nnodes 2 --node-rank 1 \
#               --master-addr hostA --master-port 29500 --secret-file ~/job.secret \
#               --steps 200 --out runs/digits
#
# A run that survives a lost node: MAX_RESTARTS=3 (pipeq's --max-restarts; REJOIN_TIMEOUT, MIN_NODES
# as below) on every node. When a node's stages fail (a stage died, or the node's host died or was
# cut off), node 0 stops the run, waits up to REJOIN_TIMEOUT seconds (default 60) for every node
# to be there again, and resumes from the newest checkpoint (checkpoint_every). Live nodes take part
# by themselves; a lost node rejoins when its command is started again, on the same host or on
# another one (the same NODE_RANK, MASTER_ADDR, secret and arguments):
#
#   host A$ MAX_RESTARTS=3 SECRET_FILE=~/job.secret workers/local.sh 0 hostA --steps 200 --out runs/digits
#   host B$ MAX_RESTARTS=3 SECRET_FILE=~/job.secret workers/local.sh 1 hostA --steps 200 --out runs/digits
#   (host B dies)
#   host C$ MAX_RESTARTS=3 SECRET_FILE=~/job.secret workers/local.sh 1 hostA --steps 200 --out runs/digits
#
# or, with MIN_NODES=1 on node 0, a node that does not come back in time has its stages re-placed
# on the nodes left (here node 0 runs all three) and the run goes on with fewer nodes:
#
#   host A$ MAX_RESTARTS=3 MIN_NODES=1 REJOIN_TIMEOUT=120 SECRET_FILE=~/job.secret \
#               workers/local.sh 0 hostA --steps 200 --out runs/digits
#
# Instead of SECRET_FILE, `export PIPEQ_SECRET=<the secret>` on every host (pipeq reads it).
# Without either, the script refuses to start: nobody without the secret can join the run.
#
# Environment:
#   SECRET_FILE=PATH          the job's secret (a file only its owner may read), passed as
#                             --secret-file; required unless PIPEQ_SECRET is set
#   PIPEQ_SECRET=SECRET       the secret itself (at least 32 characters), read by pipeq
# and optionally:
#   NNODES=2                  number of pipeq nodes (at most the job's number of stages)
#   MASTER_PORT=29500         TCP port of the rendezvous store on node 0 (open it in firewalls)
#   JOB=examples/digits.toml  the job file, relative to WORKDIR
#   BIND=ADDR_OR_IFACE        passed as --bind: what this node's stages listen on and announce
#                             (default: the local address that routes to MASTER_ADDR)
#   PYTHON=python             the interpreter that has pipeq installed
#   WORKDIR=<repo root>       where to run (the job's importable names resolve from there)
#   MAX_RESTARTS=K            passed as --max-restarts: restart the stages after a failure, up to K times
#   REJOIN_TIMEOUT=SECONDS    passed as --rejoin-timeout: how long a lost node has to rejoin (default 60)
#   MIN_NODES=N               passed as --min-nodes: re-place a lost node's stages while N nodes remain
set -euo pipefail

prog=${0##*/}

usage() {
    cat >&2 <<USAGE
usage: $prog NODE_RANK MASTER_ADDR [extra pipeq launch args...]
  host A (node 0): $prog 0 hostA --steps 200
  host B (node 1): $prog 1 hostA --steps 200
  the job's secret, the same on every host: SECRET_FILE=job.secret (make it once with
       \`python -m pipeq secret --out job.secret\` and copy it) or PIPEQ_SECRET exported
  env: NNODES (2), MASTER_PORT (29500), JOB (examples/digits.toml), BIND, PYTHON (python),
       WORKDIR (the repository root), MAX_RESTARTS, REJOIN_TIMEOUT, MIN_NODES; see the header of $0
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
[[ $# -ge 1 ]] || die "missing NODE_RANK (0 on the host that runs the driver)"
[[ $# -ge 2 ]] || die "missing MASTER_ADDR (the address of node 0's host)"
NODE_RANK=$1
MASTER_ADDR=$2
shift 2
[[ $NODE_RANK =~ ^[0-9]+$ ]] || die "NODE_RANK must be a number, got '$NODE_RANK'"
[[ -n $MASTER_ADDR ]] || die "MASTER_ADDR is empty"

NNODES=${NNODES:-2}
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
    die "no job secret: set SECRET_FILE (or export PIPEQ_SECRET), the same on every host"

bind=()
if [[ -n ${BIND:-} ]]; then
    bind=(--bind "$BIND")
fi

elastic=()  # pipeq's restarts: the same on every node (only node 0's driver acts on them)
[[ -z ${MAX_RESTARTS:-} ]] || elastic+=(--max-restarts "$MAX_RESTARTS")
[[ -z ${REJOIN_TIMEOUT:-} ]] || elastic+=(--rejoin-timeout "$REJOIN_TIMEOUT")
[[ -z ${MIN_NODES:-} ]] || elastic+=(--min-nodes "$MIN_NODES")

cmd=("$PYTHON" -m pipeq launch "$JOB" --nnodes "$NNODES" --node-rank "$NODE_RANK"
     --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" ${secret[@]+"${secret[@]}"}
     ${bind[@]+"${bind[@]}"} ${elastic[@]+"${elastic[@]}"} "$@")
echo "$prog: node $NODE_RANK of $NNODES in $PWD:$(printf ' %q' "${cmd[@]}")" >&2
exec "${cmd[@]}"
