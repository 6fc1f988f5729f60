#!/usr/bin/env bash
# launch_multi_gpu.sh: start main_multi_gpu.py on the devices this machine has.
#
# It finds the GPUs (or offers CPU training), asks only what it cannot guess,
# prints the exact command, saves it as <save-dir>/launch_command.sh and runs it.
# Every question has a flag, so it also runs unattended; see --help.
#
# Streams: the conversation (devices, questions, summary) goes to stderr and the
# command line to stdout, so `cmd=$(bash launch_multi_gpu.sh --dry-run --yes)`
# captures just the command.

if [ -z "${BASH_VERSINFO[0]:-}" ] || [ "${BASH_VERSINFO[0]}" -lt 4 ]; then
    echo "launch_multi_gpu.sh: needs bash 4 or newer" >&2
    exit 2
fi
set -euo pipefail

PROG=launch_multi_gpu.sh
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# The default rendezvous port; overridable so tests can hold a busy one.
DEFAULT_PORT=${LAUNCH_DEFAULT_PORT:-29500}
# A pipe that never delivers an answer must not hang an unattended launch.
INPUT_TIMEOUT=${LAUNCH_INPUT_TIMEOUT:-10}
CPU_DEFAULT_PROCS=2

usage() {
    cat <<EOF
Usage: bash $PROG [options] [-- main_multi_gpu.py options]

Finds the GPUs, asks what it cannot guess (in a terminal), prints the command,
saves it as <save-dir>/launch_command.sh and runs it. Flags answer the
questions; with --yes, or with no terminal on standard input, unanswered
questions take their defaults.

Devices and mode:
  --mode {ddp,dp,single}  ddp: one process per device under torchrun (default);
                          dp: nn.DataParallel in one process (GPUs only);
                          single: one device
  --gpus N                use N GPUs (the first N). On a CPU-only machine:
                          N CPU processes for ddp (gloo); default 2
  --nproc N               same as --gpus
  --gpu-ids 0,1,3         use these GPU ids (CUDA_VISIBLE_DEVICES for ddp and
                          single, --gpu-ids for dp)
Training:
  --epochs N              training epochs
  --batch-size N          samples per GPU/process per step
  --lr F                  base learning rate (for --lr-base-batch, default 32)
  --scale-lr {linear,sqrt,none}
                          scale the LR for the effective batch
                          (batch-size x devices x grad-accum-steps)
  --save-dir DIR          checkpoints and launch_command.sh go here
Multi-node (ddp; torchrun's c10d rendezvous, hosted by node 0):
  --nnodes N              number of machines (default 1)
  --node-rank R           this machine's number, 0..N-1 (required with --nnodes > 1);
                          node 0 hosts the rendezvous. Global ranks are assigned
                          by torchrun, so rank 0 (checkpoints, logs) may be on
                          any node: give a --save-dir that all nodes share
  --master-addr HOST      address of node 0 (required with --nnodes > 1)
  --master-port P         rendezvous port on node 0 (default: $DEFAULT_PORT; on a
                          single node a free port from $DEFAULT_PORT upward)
  --max-restarts K        let torchrun restart failed workers K times
Behaviour:
  -y, --yes               ask nothing: defaults for what no flag sets, no confirmation
  --dry-run               print the command and exit
  -h, --help              this help
Everything after -- goes to main_multi_gpu.py unchanged, e.g.
  bash $PROG --gpus 2 --epochs 10 -- --dataset cifar10 --amp bf16

Environment: PYTHON (interpreter; default .venv/bin/python next to this script,
else python3), LAUNCH_DEFAULT_PORT (default $DEFAULT_PORT), LAUNCH_INPUT_TIMEOUT
(seconds to wait for a piped answer, default $INPUT_TIMEOUT).
EOF
}

# --- messages --------------------------------------------------------------

say() { printf '%s\n' "$*" >&2; }

# Bad input: one line on stderr, exit 2 (same convention as main_multi_gpu.py).
die_usage() {
    printf '%s: %s\n' "$PROG" "$*" >&2
    exit 2
}

# Something outside the user's input is broken (no python, no torch): exit 1.
die() {
    printf '%s: %s\n' "$PROG" "$*" >&2
    exit 1
}

# --- command-line flags ------------------------------------------------------

# Flag values; empty means "not given", to be asked or defaulted.
MODE="" GPUS="" GPU_IDS="" EPOCHS="" BATCH="" LR="" SCALE="" SAVE_DIR=""
NNODES=1 NODE_RANK="" MASTER_ADDR="" MASTER_PORT="" MAX_RESTARTS=""
YES=0 DRY_RUN=0 FLAG_COUNT=0
PASSTHROUGH=()

parse_args() {
    local opt name value var
    while (($#)); do
        opt=$1
        shift
        case $opt in
            --) PASSTHROUGH=("$@"); return ;;
            -h | --help) usage; exit 0 ;;
        esac
        FLAG_COUNT=$((FLAG_COUNT + 1))
        case $opt in
            -y | --yes) YES=1; continue ;;
            --dry-run) DRY_RUN=1; continue ;;
        esac
        # Every other option takes a value, as "--opt value" or "--opt=value".
        name=${opt%%=*}
        case $name in
            --mode) var=MODE ;;
            --gpus | --nproc) var=GPUS ;;
            --gpu-ids) var=GPU_IDS ;;
            --epochs) var=EPOCHS ;;
            --batch-size) var=BATCH ;;
            --lr) var=LR ;;
            --scale-lr) var=SCALE ;;
            --save-dir) var=SAVE_DIR ;;
            --nnodes) var=NNODES ;;
            --node-rank) var=NODE_RANK ;;
            --master-addr) var=MASTER_ADDR ;;
            --master-port) var=MASTER_PORT ;;
            --max-restarts) var=MAX_RESTARTS ;;
            *) die_usage "unknown option $opt (see --help)" ;;
        esac
        if [[ $opt == *=* ]]; then
            value=${opt#*=}
        elif (($#)) && [[ $1 != --* ]]; then
            value=$1
            shift
        else
            value=""
        fi
        [[ -n $value ]] || die_usage "$name needs a value (see --help)"
        printf -v "$var" '%s' "$value"
    done
}

# Options after -- that the launcher itself reads (they change the effective batch).
GRAD_ACCUM=1 LR_BASE_BATCH=""

# The launcher sets these from its own flags; a copy after -- would silently win
# in main_multi_gpu.py's argparse and make the printed LR/batch a lie.
OWNED_OPTIONS=(--multi-gpu --gpu-ids --epochs --batch-size --lr --lr-scaling --save-dir)

parse_passthrough() {
    local i arg name value owned
    for ((i = 0; i < ${#PASSTHROUGH[@]}; i++)); do
        arg=${PASSTHROUGH[i]}
        name=${arg%%=*}
        for owned in "${OWNED_OPTIONS[@]}"; do
            [[ $name == "$owned" ]] &&
                die_usage "$owned after -- would override the launcher's setting; give it before -- (see --help)"
        done
        case $name in
            --grad-accum-steps | --lr-base-batch) ;;
            *) continue ;;
        esac
        if [[ $arg == *=* ]]; then
            value=${arg#*=}
        else
            value=${PASSTHROUGH[i + 1]:-}
        fi
        is_positive_int "$value" || die_usage "$name $value (after --): $WHY"
        if [[ $name == --grad-accum-steps ]]; then GRAD_ACCUM=$value; else LR_BASE_BATCH=$value; fi
    done
}

# --- python, torchrun, defaults ----------------------------------------------

pick_python() {
    if [[ -n ${PYTHON:-} ]]; then
        PY=$PYTHON
        # Made absolute so it still works from the subshells that cd.
        [[ $PY == */* && $PY != /* ]] && PY=$PWD/$PY
    elif [[ -x $SCRIPT_DIR/.venv/bin/python ]]; then
        PY=$SCRIPT_DIR/.venv/bin/python
    else
        PY=python3
    fi
    command -v "$PY" >/dev/null || die "python not found: $PY (set PYTHON=/path/to/python)"
}

# torchrun from the same environment as $PY, so workers import the same torch.
pick_torchrun() {
    local py_path
    py_path=$(command -v "$PY")
    if [[ -x $(dirname "$py_path")/torchrun ]]; then
        TORCHRUN=("$(dirname "$py_path")/torchrun")
    elif command -v torchrun >/dev/null; then
        TORCHRUN=(torchrun)
    else
        TORCHRUN=("$PY" -m torch.distributed.run)
    fi
}

# The questions' defaults are main_multi_gpu.py's own defaults (TrainConfig),
# so pressing Enter everywhere gives the same run as calling it with no flags.
read_defaults() {
    local out
    out=$(cd "$SCRIPT_DIR" && "$PY" -c '
from multigpu.config import TrainConfig
c = TrainConfig()
print(c.epochs, c.batch_size, repr(c.lr), c.lr_scaling, c.lr_base_batch, c.save_dir)' 2>&1) ||
        die "cannot read the defaults from multigpu.config with $PY: ${out##*$'\n'}"
    read -r DEF_EPOCHS DEF_BATCH DEF_LR DEF_SCALE DEF_BASE_BATCH DEF_SAVE_DIR <<<"$out"
    LR_BASE_BATCH=${LR_BASE_BATCH:-$DEF_BASE_BATCH}
}

# --- device detection (silent; printed later by show_devices) -----------------

DEV_IDS=() DEV_LINES=() DETECT_NOTE=""

# Keep only the GPUs CUDA_VISIBLE_DEVICES allows (nvidia-smi ignores it).
visible() {
    local id=$1 allowed
    [[ -n ${CUDA_VISIBLE_DEVICES+set} ]] || return 0
    [[ $CUDA_VISIBLE_DEVICES =~ ^[0-9,[:space:]]*$ ]] || return 0  # UUIDs: don't guess
    IFS=', ' read -r -a allowed <<<"$CUDA_VISIBLE_DEVICES"
    [[ " ${allowed[*]} " == *" $id "* ]]
}

add_gpus() {  # stdin: "index, name, memory" lines
    local idx name mem
    while IFS=',' read -r idx name mem; do
        idx=${idx//[[:space:]]/}
        [[ $idx =~ ^[0-9]+$ ]] || continue
        visible "$idx" || continue
        DEV_IDS+=("$idx")
        DEV_LINES+=("$(printf '  GPU %s  %s  %s' "$idx" "$(trim "$name")" "$(trim "$mem")")")
    done
}

trim() {
    local s=$1
    s=${s#"${s%%[![:space:]]*}"}
    printf '%s' "${s%"${s##*[![:space:]]}"}"
}

detect_devices() {
    local out
    if [[ -n ${CUDA_VISIBLE_DEVICES+set} && -z ${CUDA_VISIBLE_DEVICES//[[:space:]]/} ]]; then
        DETECT_NOTE="CUDA_VISIBLE_DEVICES is empty"
        return
    fi
    if command -v nvidia-smi >/dev/null &&
        out=$(nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>/dev/null); then
        add_gpus <<<"$out"
        DETECT_NOTE="nvidia-smi lists no usable GPU"
        ((${#DEV_IDS[@]})) && return
    fi
    # No nvidia-smi (or it failed): ask torch, which also covers containers
    # that have the driver libraries but not the tool.
    out=$(cd "$SCRIPT_DIR" && "$PY" -c '
import os, torch
# torch numbers the GPUs CUDA_VISIBLE_DEVICES lets through from 0; report
# the ids that variable uses, as nvidia-smi would.
visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
ids = visible if all(v.isdigit() for v in visible) else None
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"{ids[i] if ids else i}, {p.name}, {p.total_memory // 2**20} MiB")' 2>/dev/null) || out=""
    add_gpus <<<"$out"
    DETECT_NOTE="no nvidia-smi and torch.cuda sees no GPU"
}

show_devices() {
    if ((${#DEV_IDS[@]})); then
        say "Found $(plural ${#DEV_IDS[@]} GPU):"
        printf '%s\n' "${DEV_LINES[@]}" >&2
    else
        say "No CUDA GPU found ($DETECT_NOTE): training runs on the CPU ($(cpu_cores) cores)."
    fi
}

# nproc honours OMP_NUM_THREADS, which torchrun users often set to 1.
cpu_cores() { env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc; }

on_gpu() { ((${#DEV_IDS[@]} > 0)); }

# The found GPU ids as "0,1,2", or only the first N with "id_list N".
id_list() {
    local IFS=,
    printf '%s' "${DEV_IDS[*]:0:${1:-${#DEV_IDS[@]}}}"
}

# --- validators ----------------------------------------------------------------
# A validator checks $1; when it is wrong it sets WHY to an explanation and
# returns 1. It may normalise ANSWER (e.g. menu number -> mode name).

WHY="" ANSWER=""

is_positive_int() {
    WHY="not a whole number"
    [[ $1 =~ ^[0-9]{1,9}$ ]] || return 1
    WHY="must be at least 1"
    ((10#$1 >= 1))
}

is_nonneg_int() {
    WHY="not a whole number (0 or more)"
    [[ $1 =~ ^[0-9]{1,9}$ ]]
}

is_positive_float() {
    WHY="not a positive number (e.g. 0.001 or 1e-3)"
    [[ $1 =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$ ]] || return 1
    WHY="must be greater than 0"
    [[ ! $1 =~ ^[0.]*([eE].*)?$ ]]
}

valid_port() {
    WHY="not a port number (1-65535)"
    [[ $1 =~ ^[0-9]{1,5}$ ]] && ((10#$1 >= 1 && 10#$1 <= 65535))
}

MODE_CHOICES=()

valid_mode() {
    local n=$1
    if [[ $n =~ ^[0-9]+$ ]] && ((n >= 1 && n <= ${#MODE_CHOICES[@]})); then
        ANSWER=${MODE_CHOICES[n - 1]}
        return 0
    fi
    [[ " ${MODE_CHOICES[*]} " == *" $1 "* ]] && return 0
    if [[ $1 == dp ]]; then
        WHY="dp needs CUDA GPUs and none were found; choose ddp (CPU processes) or single"
    else
        WHY="choose one of: ${MODE_CHOICES[*]} (or its number)"
    fi
    return 1
}

# How many devices: GPUs to use, or CPU processes for ddp.
valid_count() {
    is_positive_int "$1" || return 1
    if on_gpu && ((10#$1 > ${#DEV_IDS[@]})); then
        WHY="only $(plural ${#DEV_IDS[@]} GPU) found (ids $(id_list))"
        return 1
    fi
    if [[ $MODE == single ]] && ((10#$1 != 1)); then
        WHY="single mode uses one device"
        return 1
    fi
    return 0
}

valid_ids() {
    local ids id seen=" "
    if ! on_gpu; then
        WHY="no GPU found, so there are no GPU ids to choose"
        return 1
    fi
    WHY="expected GPU ids separated by commas, e.g. 0,2"
    [[ $1 =~ ^[0-9]+(,[0-9]+)*,?$ ]] || return 1
    IFS=, read -r -a ids <<<"$1"
    for id in "${ids[@]}"; do
        if [[ " ${DEV_IDS[*]} " != *" $id "* ]]; then
            WHY="no GPU with id $id (found: $(id_list))"
            return 1
        fi
        if [[ $seen == *" $id "* ]]; then
            WHY="GPU $id is listed twice"
            return 1
        fi
        seen+="$id "
    done
    if [[ $MODE == single ]] && ((${#ids[@]} != 1)); then
        WHY="single mode uses one GPU; give one id"
        return 1
    fi
}

# The GPU question takes "all", a count ("2": the first two) or ids ("0,2";
# one id needs a trailing comma, "3,", to tell it from a count).
valid_gpu_choice() {
    if [[ $1 == all ]]; then return 0; fi
    if [[ $1 == *,* ]]; then valid_ids "$1"; else valid_count "$1"; fi
}

valid_scale() {
    case $1 in
        linear | sqrt | none) return 0 ;;
        no) ANSWER=none; return 0 ;;
    esac
    WHY="choose linear, sqrt or none"
    return 1
}

valid_yes_no() {
    case ${1,,} in
        y | yes) ANSWER=y; return 0 ;;
        n | no) ANSWER=n; return 0 ;;
    esac
    WHY="answer y or n"
    return 1
}

# Apply a validator to a flag value: one line and exit 2 when it is wrong.
check_flag() {
    local flag=$1 value=$2 validator=$3
    [[ -z $value ]] && return 0
    "$validator" "$value" || die_usage "$flag $value: $WHY"
}

# --- questions -------------------------------------------------------------------

# ASK is terminal (a person at a terminal), pipe (answers piped in, one per line) or
# none (take the defaults). Piped answers are read only when no flag was given:
# flags mean "configured by a script", and its stdin may be anything.
decide_asking() {
    if ((YES)); then
        ASK=none
    elif [[ -t 0 ]]; then
        ASK=terminal
    elif ((FLAG_COUNT == 0)); then
        ASK=pipe
    else
        ASK=none
    fi
    INPUT_DONE=0
}

# Read one answer into LINE. Returns 1 at end of input or after INPUT_TIMEOUT
# seconds without a line on a pipe; from then on every question takes its
# default, so an exhausted or silent stdin can never loop or hang.
read_line() {
    LINE=""
    ((INPUT_DONE)) && return 1
    local rc=0
    if [[ $ASK == terminal ]]; then
        IFS= read -r LINE || rc=$?
    else
        IFS= read -r -t "$INPUT_TIMEOUT" LINE || rc=$?
        if ((rc > 128)); then
            LINE=""
            INPUT_DONE=1
            say "(no answer on standard input within ${INPUT_TIMEOUT}s: taking the defaults)"
            return 1
        fi
        # A pipe does not echo: show the answer so the log reads like a session.
        printf '%s\n' "$LINE" >&2
    fi
    LINE=$(trim "${LINE%$'\r'}")
    if ((rc != 0)); then
        INPUT_DONE=1
        [[ -n $LINE ]] && return 0  # last line without a newline
        [[ $ASK == terminal ]] && printf '\n' >&2
        return 1
    fi
}

# ask PROMPT DEFAULT VALIDATOR: sets ANSWER, asking again with the reason
# until the validator accepts. Enter (or no more input) takes DEFAULT.
ask() {
    local prompt=$1 default=$2 validator=$3
    if [[ $ASK == none ]]; then
        ANSWER=$default
        "$validator" "$default" || die "bug: default '$default' for '$prompt' is invalid: $WHY"
        return 0
    fi
    while true; do
        printf '%s [%s]: ' "$prompt" "$default" >&2
        read_line || true
        ANSWER=${LINE:-$default}
        "$validator" "$ANSWER" && return 0
        say "  '$ANSWER': $WHY."
        ((INPUT_DONE)) && [[ -z $LINE ]] && die "bug: default '$default' for '$prompt' is invalid"
    done
}

ask_mode() {
    if on_gpu; then
        MODE_CHOICES=(ddp dp single)
        MENU=("ddp     one process per GPU, DistributedDataParallel (recommended)"
            "dp      one process, nn.DataParallel over the GPUs (simpler, slower)"
            "single  one GPU")
    else
        MODE_CHOICES=(ddp single)
        MENU=("ddp     several CPU processes, DistributedDataParallel with gloo (recommended)"
            "single  one process")
    fi
    if [[ $ASK != none ]]; then
        say "How should it train?"
        local i
        for i in "${!MENU[@]}"; do say "  $((i + 1))) ${MENU[i]}"; done
    fi
    ask "Mode" ddp valid_mode
    MODE=$ANSWER
}

# Sets COUNT (devices per node) and IDS (chosen GPU ids, may be empty).
ask_devices() {
    COUNT="" IDS=$GPU_IDS
    if [[ -n $GPUS ]]; then
        COUNT=$((10#$GPUS))
    elif [[ -n $IDS ]]; then
        :
    elif ! on_gpu; then
        if [[ $MODE == ddp ]]; then
            ask "CPU processes" "$CPU_DEFAULT_PROCS" valid_count
            COUNT=$ANSWER
            if ((COUNT > $(cpu_cores))); then
                say "  (note: $COUNT processes on $(cpu_cores) cores will compete for the CPU)"
            fi
        else
            COUNT=1
        fi
    elif [[ $MODE == single ]]; then
        # With several GPUs, say which one; with one there is nothing to choose.
        if ((${#DEV_IDS[@]} > 1)); then
            ask "GPU id" "${DEV_IDS[0]}" valid_ids
            IDS=${ANSWER%,}
        else
            COUNT=1
        fi
    elif ((${#DEV_IDS[@]} > 1)); then
        ask "GPUs: all, a count (2 = the first two) or ids (0,2; one id as 3,)" all valid_gpu_choice
        case $ANSWER in
            all) COUNT=${#DEV_IDS[@]} ;;
            *,*) IDS=${ANSWER%,} ;;
            *) COUNT=$ANSWER ;;
        esac
    else
        COUNT=1
    fi
    if [[ -n $IDS ]]; then
        local ids
        IFS=, read -r -a ids <<<"$IDS"
        COUNT=${#ids[@]}
    fi
}

ask_training() {
    if [[ -z $EPOCHS ]]; then ask "Epochs" "$DEF_EPOCHS" is_positive_int; EPOCHS=$ANSWER; fi
    if [[ -z $BATCH ]]; then ask "Batch size per $(unit)" "$DEF_BATCH" is_positive_int; BATCH=$ANSWER; fi
    if [[ -z $LR ]]; then ask "Base learning rate (tuned for batch $LR_BASE_BATCH)" "$DEF_LR" is_positive_float; LR=$ANSWER; fi
    if [[ -z $SCALE ]]; then
        [[ $ASK == none ]] || say "Effective batch: $(effective_batch_text)"
        ask "Scale the LR for it: linear, sqrt or none" "$DEF_SCALE" valid_scale
        SCALE=$ANSWER
    fi
    SAVE_DIR=${SAVE_DIR:-$DEF_SAVE_DIR}
}

# What one batch-size unit runs on: a GPU, or a CPU process.
unit() { if on_gpu; then echo GPU; else echo process; fi; }

# plural N WORD: "1 GPU", "2 GPUs", "2 processes".
plural() {
    local n=$1 word=$2
    if ((n == 1)); then
        printf '%s %s' "$n" "$word"
    elif [[ $word == *s ]]; then
        printf '%s %ses' "$n" "$word"
    else
        printf '%s %ss' "$n" "$word"
    fi
}

# Devices whose batches add up to one step: all ranks for ddp, the GPUs for dp.
devices_total() {
    case $MODE in
        ddp) echo $((COUNT * NNODES)) ;;
        dp) echo "$COUNT" ;;
        *) echo 1 ;;
    esac
}

effective_batch() { echo $((BATCH * $(devices_total) * GRAD_ACCUM)); }

effective_batch_text() {
    printf '%s = %s per %s x %s x %s' "$(effective_batch)" "$BATCH" "$(unit)" \
        "$(plural "$(devices_total)" "$(unit)")" "$(plural "$GRAD_ACCUM" "accumulation step")"
}

# The LR formula lives in multigpu/lr_scaling.py only; ask it rather than redo it.
compute_lr() {
    local out
    out=$(cd "$SCRIPT_DIR" && "$PY" -m multigpu.lr_scaling --lr "$LR" --lr-scaling "$SCALE" \
        --effective-batch "$(effective_batch)" --lr-base-batch "$LR_BASE_BATCH" 2>&1) ||
        die "computing the LR with $PY -m multigpu.lr_scaling failed: ${out##*$'\n'}"
    LR_USED=$out
}

# --- rendezvous port -------------------------------------------------------------

# "pick P": print the first free TCP port from P upward (else one the OS picks);
# "check P": exit 0 if P is free. Free means bindable on all IPv4 and IPv6
# addresses, which is what torchrun's TCP store will do.
port_tool() {
    "$PY" - "$@" <<'EOF'
import errno, socket, sys

def free(port):
    for family, host in ((socket.AF_INET, ""), (socket.AF_INET6, "::")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this machine
        try:
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind((host, port))
        except OSError as e:
            if family == socket.AF_INET or e.errno == errno.EADDRINUSE:
                return False
        finally:
            s.close()
    return True

action, port = sys.argv[1], int(sys.argv[2])
if action == "check":
    sys.exit(0 if free(port) else 1)
for p in range(port, min(port + 100, 65536)):
    if free(p):
        print(p)
        sys.exit(0)
s = socket.socket()
s.bind(("", 0))
print(s.getsockname()[1])
EOF
}

# Ports are settled before any output, so a busy one is a one-line error.
choose_port() {
    if ((NNODES > 1)); then
        # Every node must name the same port, so it cannot be picked at random;
        # node 0 hosts the rendezvous and can at least check it is free.
        PORT=${MASTER_PORT:-$DEFAULT_PORT}
        if ((NODE_RANK == 0)) && ! port_tool check "$PORT"; then
            die_usage "port $PORT is busy on this machine (node 0); choose a free one with --master-port, the same on every node"
        fi
    elif [[ -n $MASTER_PORT ]]; then
        PORT=$MASTER_PORT
        port_tool check "$PORT" || die_usage "--master-port $PORT: the port is busy; choose another or leave it out to pick a free one"
    else
        PORT=$(port_tool pick "$DEFAULT_PORT")
        PORT_NOTE=""
        [[ $PORT == "$DEFAULT_PORT" ]] || PORT_NOTE="Port $DEFAULT_PORT is busy: using port $PORT for the rendezvous."
    fi
}

# --- the command -----------------------------------------------------------------

# Paths under the current directory are shown relative: shorter, and
# launch_command.sh cds here first, so they still resolve.
short() {
    local p=$1
    [[ $p == "$PWD"/* ]] && p=${p#"$PWD"/}
    printf '%s' "$p"
}

build_command() {
    local main
    main=$(short "$SCRIPT_DIR/main_multi_gpu.py")
    ENV_VARS=() CMD=()
    if [[ -n $IDS && $MODE != dp ]]; then
        ENV_VARS=("CUDA_VISIBLE_DEVICES=$IDS")
    fi
    if [[ $MODE == ddp ]]; then
        CMD=("$(short "${TORCHRUN[0]}")" "${TORCHRUN[@]:1}" "--nproc_per_node=$COUNT")
        if ((NNODES > 1)); then
            # c10d rendezvous: node 0 hosts its store at MASTER_ADDR:PORT (said
            # explicitly, not guessed from the address); the id only has to be
            # the same on every node, as the port is.
            CMD+=("--nnodes=$NNODES" --rdzv_backend=c10d "--rdzv_endpoint=$(endpoint_host):$PORT"
                "--rdzv_id=multigpu-$PORT" "--rdzv_conf=is_host=$((NODE_RANK == 0))")
        else
            [[ -z $MASTER_ADDR ]] || CMD+=("--master_addr=$MASTER_ADDR")
            CMD+=("--master_port=$PORT")
        fi
        [[ -z $MAX_RESTARTS ]] || CMD+=("--max_restarts=$MAX_RESTARTS")
        CMD+=("$main" --multi-gpu ddp)
    else
        CMD=("$(short "$PY")" "$main")
        if [[ $MODE == dp ]]; then
            CMD+=(--multi-gpu dp)
            if [[ -n $IDS ]]; then
                CMD+=(--gpu-ids "$IDS")
            elif ((COUNT < ${#DEV_IDS[@]})); then
                CMD+=(--gpu-ids "$(id_list "$COUNT")")
            fi
        else
            CMD+=(--multi-gpu none)
        fi
    fi
    CMD+=(--epochs "$EPOCHS" --batch-size "$BATCH" --lr "$LR" --lr-scaling "$SCALE" --save-dir "$SAVE_DIR")
    CMD+=("${PASSTHROUGH[@]}")
}

# An IPv6 address needs brackets in host:port.
endpoint_host() {
    if [[ $MASTER_ADDR == *:* && $MASTER_ADDR != \[* ]]; then
        printf '[%s]' "$MASTER_ADDR"
    else
        printf '%s' "$MASTER_ADDR"
    fi
}

# Shell-quote only what needs it, so the printed line stays readable.
quote() {
    if [[ $1 =~ ^[A-Za-z0-9_./,:=@%+-]+$ ]]; then
        printf '%s' "$1"
    else
        printf '%q' "$1"
    fi
}

command_line() {
    local words=() w
    for w in "${ENV_VARS[@]}" "${CMD[@]}"; do
        words+=("$(quote "$w")")
    done
    printf '%s' "${words[*]}"
}

# "DDP with 4 GPUs", "DataParallel over GPUs 0,2", "one CPU process", ...
device_phrase() {
    local devices
    if [[ -n $IDS ]]; then
        devices="GPUs $IDS"
        [[ $IDS == *,* ]] || devices="GPU $IDS"
    elif on_gpu; then
        devices=$(plural "$COUNT" GPU)
    else
        devices="$(plural "$COUNT" "CPU process") (gloo)"
    fi
    case $MODE in
        ddp) printf 'DDP with %s' "$devices" ;;
        dp) printf 'DataParallel over %s' "$devices" ;;
        *) if on_gpu; then printf 'one GPU%s' "${IDS:+ (id $IDS)}"; else printf 'one CPU process'; fi ;;
    esac
    if ((NNODES > 1)); then
        printf ' per node x %s nodes (this is node %s)' "$NNODES" "$NODE_RANK"
    fi
}

show_plan() {
    say ""
    say "Plan: $(device_phrase)"
    say "  epochs $EPOCHS; effective batch $(effective_batch_text)"
    if [[ $SCALE == none ]]; then
        say "  lr $LR_USED (not scaled)"
    else
        say "  lr $LR_USED = $LR x $SCALE($(effective_batch)/$LR_BASE_BATCH)"
    fi
    say "  checkpoints and launch_command.sh in $SAVE_DIR/"
    if ((NNODES > 1)); then
        say "  checkpoints come from global rank 0, which c10d may place on any node: use a --save-dir all nodes share"
    fi
    if [[ $MODE == ddp && -n ${PORT_NOTE:-} ]]; then say "  $PORT_NOTE"; fi
    say "Command:"
    printf '%s\n' "$(command_line)"
}

confirm() {
    [[ $ASK == none ]] && return 0  # --yes, or nothing to ask
    ask "Run it? (y/n)" y valid_yes_no
    if [[ $ANSWER == n ]]; then
        say "Not started; the command above runs it."
        exit 0
    fi
}

save_command() {
    local file=$SAVE_DIR/launch_command.sh
    mkdir -p "$SAVE_DIR" || die "cannot create $SAVE_DIR"
    {
        echo "#!/usr/bin/env bash"
        echo "# Written by $PROG on $(date '+%Y-%m-%d %H:%M:%S'): repeats this run."
        echo "# Extra arguments go to main_multi_gpu.py, e.g. --resume auto."
        echo "cd $(quote "$PWD") || exit 1"
        echo "$(command_line) \"\$@\""
    } >"$file" || die "cannot write $file"
    chmod +x "$file"
    say "Saved as $file"
}

run_command() {
    [[ -f $SCRIPT_DIR/main_multi_gpu.py ]] || die "main_multi_gpu.py not found in $SCRIPT_DIR"
    say ""
    if ((${#ENV_VARS[@]})); then
        exec env "${ENV_VARS[@]}" "${CMD[@]}"
    fi
    exec "${CMD[@]}"
}

# --- flag checks that need the detected devices ----------------------------------

check_flags() {
    valid_port "$DEFAULT_PORT" || die_usage "LAUNCH_DEFAULT_PORT=$DEFAULT_PORT: $WHY"
    is_positive_float "$INPUT_TIMEOUT" || die_usage "LAUNCH_INPUT_TIMEOUT=$INPUT_TIMEOUT: $WHY"
    [[ -z $MODE ]] || case $MODE in
        ddp | single) ;;
        dp) on_gpu || die_usage "--mode dp needs CUDA GPUs and none were found; use --mode ddp (CPU processes) or single" ;;
        *) die_usage "--mode $MODE: choose ddp, dp or single" ;;
    esac
    [[ -n $GPUS && -n $GPU_IDS ]] && die_usage "give --gpus or --gpu-ids, not both"
    check_device_flags
    GPU_IDS=${GPU_IDS%,}
    check_flag --epochs "$EPOCHS" is_positive_int
    check_flag --batch-size "$BATCH" is_positive_int
    check_flag --lr "$LR" is_positive_float
    check_flag --scale-lr "$SCALE" valid_scale
    [[ $SCALE == no ]] && SCALE=none
    check_flag --nnodes "$NNODES" is_positive_int
    check_flag --node-rank "$NODE_RANK" is_nonneg_int
    check_flag --max-restarts "$MAX_RESTARTS" is_nonneg_int
    check_flag --master-port "$MASTER_PORT" valid_port
    NNODES=$((10#$NNODES))
    if ((NNODES > 1)); then
        [[ -z $MODE || $MODE == ddp ]] || die_usage "--nnodes $NNODES needs --mode ddp"
        MODE=ddp
        [[ -n $NODE_RANK ]] || die_usage "--nnodes $NNODES needs --node-rank: 0 on the master node, 1 to $((NNODES - 1)) on the others"
        NODE_RANK=$((10#$NODE_RANK))
        ((NODE_RANK < NNODES)) || die_usage "--node-rank $NODE_RANK: must be below --nnodes $NNODES"
        [[ -n $MASTER_ADDR ]] || die_usage "--nnodes $NNODES needs --master-addr (the address of node 0)"
    elif [[ -n $NODE_RANK && $NODE_RANK != 0 ]]; then
        die_usage "--node-rank $NODE_RANK needs --nnodes above 1"
    fi
    return 0
}

# Checked with the flags and again once the mode is chosen (single takes one device).
check_device_flags() {
    check_flag --gpus "$GPUS" valid_count
    check_flag --gpu-ids "$GPU_IDS" valid_ids
}

# --- main --------------------------------------------------------------------------

main() {
    parse_args "$@"
    parse_passthrough
    pick_python
    pick_torchrun
    detect_devices
    check_flags
    read_defaults
    choose_port
    decide_asking
    show_devices
    [[ -n $MODE ]] || ask_mode
    check_device_flags
    ask_devices
    ask_training
    compute_lr
    build_command
    show_plan
    ((DRY_RUN)) && exit 0
    confirm
    save_command
    run_command
}

main "$@"
