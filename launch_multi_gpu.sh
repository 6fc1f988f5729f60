#!/usr/bin/env bash
# launch_multi_gpu.sh: start main_multi_gpu.py on the devices this machine has, or write a SLURM job or a
# Kubernetes TrainJob, or run it on Ray.
#
# It finds the GPUs (or offers CPU training), asks only what it cannot guess,
# prints the exact command, saves it as <save-dir>/launch_command.sh and runs it.
# Every question has a flag, so it also runs unattended; see --help.
#
# This script keeps the conversation and runs the command. Every check of a
# value and every number shown (effective batch, LR, the command, the SLURM
# script, the TrainJob) comes from multigpu/launch/launch_rules.py, which asks the trainer's own
# TrainConfig: the launcher cannot accept what the trainer would refuse.
#
# Streams: the conversation goes to stderr and the command line (or SLURM
# script) to stdout, so `cmd=$(bash launch_multi_gpu.sh --dry-run --yes)`
# captures just the command.

if [ -z "${BASH_VERSION:-}" ]; then
    echo "launch_multi_gpu.sh: run it with bash: bash launch_multi_gpu.sh" >&2
    exit 2
fi
if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 404)); then
    echo "launch_multi_gpu.sh: needs bash 4.4 or newer" >&2
    exit 2
fi
set -euo pipefail

PROG=launch_multi_gpu.sh
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# A pipe that never delivers an answer must not hang an unattended launch.
INPUT_TIMEOUT=${LAUNCH_INPUT_TIMEOUT:-10}

usage() {
    cat <<EOF
Usage: bash $PROG [options] [-- main_multi_gpu.py options]

Finds the GPUs, asks what it cannot guess (in a terminal), prints the command,
saves it as <save-dir>/launch_command.sh and runs it. Flags answer the
questions; with --yes, or with flags and no terminal on standard input,
unanswered questions take their defaults. End of input at a question (Ctrl-D)
stops it without running anything.

Devices:
  --multi-gpu {ddp,fsdp,dp,none}
                          ddp: one process per device under torchrun (default);
                          fsdp: the same, the model sharded over the processes
                          (FSDP2: for models too big for one device);
                          dp: nn.DataParallel in one process (GPUs only);
                          none: one device
  --mode {ddp,fsdp,dp,single}
                          the same (single = none)
  --gpus N                use N GPUs (the first N). On a CPU-only machine:
                          N CPU processes for ddp and fsdp (gloo); default 2
  --nproc N               same as --gpus
  --gpu-ids 0,1,3         use these GPU ids (CUDA_VISIBLE_DEVICES for ddp, fsdp
                          and none, --gpu-ids for dp)
  --oversubscribe         CPU only: allow more processes than CPU cores
                          (refused without it)
Training (main_multi_gpu.py's flags of the same names):
  --epochs N              training epochs
  --batch-size N          samples per GPU/process per step
  --lr F                  base learning rate (for --lr-base-batch, default 32)
  --lr-scaling {linear,sqrt,none}
                          scale the LR for the effective batch
                          (batch-size x devices x grad-accum-steps)
  --scale-lr ...          the same
  --save-dir DIR          checkpoints, launch_command.sh, torchrun.log
  --lora-r R              a language model folder (-- --model hf --model-path DIR):
                          train LoRA adapters of rank R, the base frozen (asked
                          when not given; 0: every weight)
  --qlora                 with --lora-r: the base's linear layers in 4-bit NF4
Multi-node (ddp or fsdp; torchrun's c10d rendezvous, hosted by node 0):
  --nnodes N              number of machines (default 1)
  --node-rank R           this machine's number, 0..N-1 (required with --nnodes > 1)
  --master-addr HOST      address of node 0 (required with --nnodes > 1)
  --master-port P         rendezvous port (default: ${LAUNCH_DEFAULT_PORT:-29500}; on a
                          single node a free port from there upward)
  --max-restarts K        let torchrun restart failed workers K times
  --dp-replicate R        fsdp: replicate the model over R groups of processes,
                          sharded within each (hybrid sharding; default with
                          --nnodes N: R = N, each node one group)
  --dp-shard S            fsdp: processes per shard group (default: per node;
                          -1: the processes left after --dp-replicate)
SLURM (writes <save-dir>/launch_slurm.sbatch and prints it):
  --slurm                 a job script instead of a run: --nnodes N nodes with
                          --gpus G GPUs each (default: as many as here; 0: --nproc
                          CPU processes, default 2), one torchrun per node
  --partition P           SLURM partition (queue)
  --time HH:MM:SS         time limit; the job checkpoints and requeues itself
                          when SLURM warns 120 s before it
  --account A             account to charge
  --cpus-per-task C       CPUs per node (default: 5 per GPU, 1 per CPU process)
  --submit                also submit it with sbatch and print the job id
Kubernetes (writes <save-dir>/trainjob.yaml, a Kubeflow Trainer TrainJob, and prints it):
  --k8s                   a TrainJob on the runtime torch-distributed instead of a
                          run: --nnodes N pods with --gpus G GPUs each (0: --nproc
                          CPU processes), one torchrun per pod, --resume auto
  --image IMAGE           the container image holding this repository as its
                          working directory (default: multigpu-train:latest)
  --k8s-pvc NAME          mount the PersistentVolumeClaim NAME at --save-dir (an
                          absolute path) in every pod; needed with --nnodes > 1
  --cpus-per-task C       CPUs per pod (default: 5 per GPU, 1 per CPU process)
  --submit                also apply it with kubectl
Ray (runs main_multi_gpu.py --ray-workers N; see docs/launcher.md, "Ray"):
  --ray                   train as Ray Train workers: --gpus G workers with a GPU
                          each, or --gpus 0 and --nproc N CPU workers (gloo)
  --ray-address ADDR      HOST:PORT of the Ray head, or auto (default: RAY_ADDRESS,
                          else a new local Ray instance)
  --ray-max-failures K    let Ray restart the workers after up to K failures
Fault tolerance (torchft; docs/fault-tolerance.md):
  --fault-tolerance       train as replica groups that outlive each other's loss:
                          a torchft Lighthouse and --replica-groups groups on this
                          machine, each one process, or with --gpus P a torchrun
                          job of P processes (GPUs, or CPU processes) training
                          with --multi-gpu ddp (default) or fsdp; with --slurm one
                          group per node, the Lighthouse on the first; a lost
                          group's share of the data is skipped until torchrun
                          restarts it (--max-restarts, default 3) and it heals
                          from a live peer
  --replica-groups N      how many replica groups (default 2)
  --sync-every H          sync the groups every H steps (default 1: every step's
                          gradients; more: DiLoCo, H times fewer bytes between
                          them, for slow links; asked when not given)
  --lighthouse-port P     the Lighthouse's port (default 29510; here a free one
                          from there upward)
Behaviour:
  -y, --yes               ask nothing: defaults for what no flag sets, no confirmation
  --dry-run               print the command (or script) and exit; writes nothing
  -h, --help              this help
Everything after -- goes to main_multi_gpu.py unchanged, e.g.
  bash $PROG --gpus 2 --epochs 10 -- --dataset cifar10 --amp bf16
but for the trainer flags this launcher sets (--multi-gpu, --gpu-ids, --epochs,
--batch-size, --lr, --lr-scaling, --save-dir, --dp-replicate, --dp-shard):
give them before --, where they count in the batch and LR shown.

Exit status: the run's (0 done or stopped cleanly by a signal, 1 failed,
2 bad input, 3 hung: see SAVE_DIR/hang_report.txt); 2 for a bad flag here,
130 for end of input at a question.
Environment: PYTHON (interpreter; default .venv/bin/python next to this
script, else python3), LAUNCH_DEFAULT_PORT, LAUNCH_INPUT_TIMEOUT (seconds to
wait for a piped answer, default $INPUT_TIMEOUT).
EOF
}

# --- state: what the user said, what the rules answered, what was found ---------

declare -A SET=()     # flags and answers, by the launcher's flag name: SET[epochs]=3
declare -A RULES=()   # the rule set's last answer: defaults, effective-batch, command, error, ...
PLAN=()               # the plan lines of the rule set's last answer
PASSTHROUGH=()        # the trainer's own options, after --
MENU=()               # the choices of the menu on screen, if any
FOUND_IDS=() FOUND_LINES=() FOUND_NOTE=""
YES=0 DRY_RUN=0 SUBMIT=0 FLAG_COUNT=0

say() { printf '%s\n' "$*" >&2; }

# Bad input: one line on stderr, exit 2 (as main_multi_gpu.py does).
die_usage() {
    printf '%s: %s\n' "$PROG" "$*" >&2
    exit 2
}

# Something outside the user's input is broken (no python, a bug): exit 1.
die() {
    printf '%s: %s\n' "$PROG" "$*" >&2
    exit 1
}

# --- flags ----------------------------------------------------------------------------

parse_args() {
    local opt name key value
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
            --submit) SUBMIT=1; continue ;;
            --slurm) SET[slurm]=1; continue ;;
            --k8s) SET[k8s]=1; continue ;;
            --ray) SET[ray]=1; continue ;;
            --fault-tolerance) SET[fault-tolerance]=1; continue ;;
            --qlora) SET[qlora]=1; continue ;;
            --oversubscribe) SET[oversubscribe]=1; continue ;;
        esac
        # Every other option takes a value, as "--opt value" or "--opt=value".
        name=${opt%%=*}
        case $name in
            --mode) key=multi-gpu ;;
            --scale-lr) key=lr-scaling ;;
            --multi-gpu | --gpus | --nproc | --gpu-ids | --epochs | --batch-size | --lr | --lr-scaling | \
                --save-dir | --nnodes | --node-rank | --master-addr | --master-port | --max-restarts | \
                --dp-replicate | --dp-shard | --partition | --time | --account | --cpus-per-task | --image | \
                --k8s-pvc | --ray-address | --ray-max-failures | --replica-groups | --lighthouse-port | \
                --lora-r | --sync-every) key=${name#--} ;;
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
        SET[$key]=$value
    done
}

pick_python() {
    if [[ -n ${PYTHON:-} ]]; then
        PY=$PYTHON
        [[ $PY == */* && $PY != /* ]] && PY=$PWD/$PY
    elif [[ -x $SCRIPT_DIR/.venv/bin/python ]]; then
        PY=$SCRIPT_DIR/.venv/bin/python
    else
        PY=python3
    fi
    command -v "$PY" >/dev/null || die "python not found: $PY (set PYTHON=/path/to/python)"
}

# --- the rule set ------------------------------------------------------------------------

# rules STEP [--name value ...]: ask multigpu/launch/launch_rules.py about SET (plus the extra
# settings, which win) and what was found. Fills RULES and PLAN, copies the normalised
# settings into SET; returns 2 with the reason in RULES[error] when it refuses.
rules() {
    local args=() key record records status=0
    for key in "${!SET[@]}"; do args+=("--$key" "${SET[$key]}"); done
    args+=(--found-gpus "$(ids_csv)" --python "$PY" --default-port "${LAUNCH_DEFAULT_PORT:-29500}")
    mapfile -d '' records < <(PYTHONPATH=$SCRIPT_DIR${PYTHONPATH:+:$PYTHONPATH} \
        "$PY" -m multigpu.launch.launch_rules "$1" "${args[@]}" "${@:2}" -- "${PASSTHROUGH[@]}")
    wait $! || status=$?
    RULES=() PLAN=()
    for record in "${records[@]}"; do
        key=${record%%=*}
        case $key in
            plan) PLAN+=("${record#*=}") ;;
            set:*) SET[${key#set:}]=${record#*=} ;;
            *) RULES[$key]=${record#*=} ;;
        esac
    done
    [[ -n ${RULES[ok]:-} || -n ${RULES[error]:-} ]] || die "$PY -m multigpu.launch.launch_rules $1 failed (status $status)"
    [[ -z ${RULES[error]:-} ]] || return 2
}

# Standard input becomes FILE (its folders created), written by the project's one writer
# (multigpu/safe_files.py): whole or not at all, and never through a symbolic link planted at FILE.
save_file() {
    local file=$1 said status=0
    said=$(PYTHONPATH=$SCRIPT_DIR${PYTHONPATH:+:$PYTHONPATH} "$PY" -m multigpu.safe_files write "$@" 2>&1) ||
        status=$?
    ((status == 0)) && return 0
    ((status == 2)) && die_usage "${said:-refused to write $file}"
    die "${said:-cannot write $file}"
}

# --- devices --------------------------------------------------------------------------

# GPUs nvidia-smi (or, without it, torch) lists, less those CUDA_VISIBLE_DEVICES hides.
detect_devices() {
    local out idx name mem
    if [[ -n ${CUDA_VISIBLE_DEVICES+set} && -z ${CUDA_VISIBLE_DEVICES//[[:space:]]/} ]]; then
        FOUND_NOTE="CUDA_VISIBLE_DEVICES is empty"
        return
    fi
    FOUND_NOTE="no nvidia-smi and torch.cuda sees no GPU"
    if command -v nvidia-smi >/dev/null &&
        out=$(nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>/dev/null); then
        FOUND_NOTE="nvidia-smi lists no usable GPU"
    else
        # torch numbers the GPUs CUDA_VISIBLE_DEVICES lets through from 0: report its ids, as nvidia-smi would.
        out=$("$PY" -c '
import os, torch
visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
ids = visible if all(v.isdigit() for v in visible) else None
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"{ids[i] if ids else i}, {p.name}, {p.total_memory // 2**20} MiB")' 2>/dev/null) || out=""
    fi
    while IFS=, read -r idx name mem; do
        idx=${idx//[[:space:]]/}
        if [[ ! $idx =~ ^[0-9]+$ ]] || ! visible "$idx"; then continue; fi
        FOUND_IDS+=("$idx")
        FOUND_LINES+=("$(printf '  GPU %s  %s  %s' "$idx" "$(trim "$name")" "$(trim "$mem")")")
    done <<<"$out"
}

# nvidia-smi ignores CUDA_VISIBLE_DEVICES; ids only (UUIDs: don't guess).
visible() {
    local allowed
    [[ -n ${CUDA_VISIBLE_DEVICES+set} && $CUDA_VISIBLE_DEVICES =~ ^[0-9,[:space:]]*$ ]] || return 0
    IFS=', ' read -r -a allowed <<<"$CUDA_VISIBLE_DEVICES"
    [[ " ${allowed[*]} " == *" $1 "* ]]
}

trim() {
    local s=$1
    s=${s#"${s%%[![:space:]]*}"}
    printf '%s' "${s%"${s##*[![:space:]]}"}"
}

ids_csv() {
    local IFS=,
    printf '%s' "${FOUND_IDS[*]}"
}

on_gpu() { ((${#FOUND_IDS[@]} > 0)); }

# nproc honours OMP_NUM_THREADS, which torchrun users often set to 1.
cpu_cores() { env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc; }

show_devices() {
    if on_gpu; then
        say "Found ${#FOUND_IDS[@]} GPU$( ((${#FOUND_IDS[@]} == 1)) || echo s):"
        printf '%s\n' "${FOUND_LINES[@]}" >&2
    else
        say "No CUDA GPU found ($FOUND_NOTE): training runs on the CPU ($(cpu_cores) cores)."
    fi
}

# --- questions ------------------------------------------------------------------------

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
    INPUT_DONE=0 INPUT_ENDED=0
}

# Read one answer into LINE. End of input (Ctrl-D at a terminal, or piped answers
# that run out) stops the launcher without running anything: only --yes takes the
# defaults. Returns 1 after INPUT_TIMEOUT seconds without a line on a pipe; from
# then on every question takes its default, so a silent stdin never hangs.
read_line() {
    LINE=""
    ((INPUT_DONE)) && return 1
    ((INPUT_ENDED)) && end_of_input
    local rc=0
    if [[ $ASK == terminal ]]; then
        IFS= read -r LINE || rc=$?
    else
        IFS= read -r -t "$INPUT_TIMEOUT" LINE || rc=$?
        if ((rc > 128)); then
            LINE="" INPUT_DONE=1
            say "(no answer on standard input within ${INPUT_TIMEOUT}s: taking the defaults)"
            return 1
        fi
        printf '%s\n' "$LINE" >&2  # a pipe does not echo: show the answer so the log reads like a session
    fi
    LINE=$(trim "${LINE%$'\r'}")
    if ((rc != 0)); then
        [[ -n $LINE ]] || end_of_input
        INPUT_ENDED=1  # a last line without a newline is still an answer; the next question ends the input
    fi
}

end_of_input() {
    [[ $ASK == terminal ]] && printf '\n' >&2
    printf '%s: end of input: nothing was run (answer every question, or give --yes to take the defaults)\n' \
        "$PROG" >&2
    exit 130
}

# ask PROMPT DEFAULT KEY: settles SET[KEY], asking again with the rule set's reason until
# it accepts (it stores the answer, normalised). Enter (or a silent pipe) takes DEFAULT,
# which the rules gave. A number picks from MENU, when a menu was shown.
ask() {
    local prompt=$1 default=$2 key=$3 answer
    if [[ $ASK == none ]]; then
        SET[$key]=$default
        return 0
    fi
    while true; do
        printf '%s [%s]: ' "$prompt" "$default" >&2
        read_line || true
        answer=${LINE:-$default}
        if [[ $answer =~ ^[0-9]+$ ]] && ((${#MENU[@]})); then
            if ((answer < 1 || answer > ${#MENU[@]})); then  # a number off the menu is no mode's name either
                say "  $answer is not on the menu: answer 1-${#MENU[@]}, or one of $(menu_names)"
                continue
            fi
            answer=${MENU[answer - 1]}
        fi
        rules check "--$key" "$answer" && return 0
        say "  ${RULES[error]}"
        ((INPUT_DONE)) && [[ -z $LINE ]] && die "bug: the default '$default' for '$prompt' is refused"
    done
}

# menu_names: the names of the menu on screen, "ddp, none, fsdp".
menu_names() {
    local names="${MENU[*]}"
    printf '%s' "${names// /, }"
}

ask_mode() {
    local menu=() i
    if on_gpu; then
        menu=("ddp     one process per GPU, DistributedDataParallel (recommended)"
            "dp      one process, nn.DataParallel over the GPUs (simpler, slower)"
            "none    one GPU"
            "fsdp    one process per GPU, the model sharded over them (FSDP2: when it does not fit one GPU)")
    else
        menu=("ddp     several CPU processes, DistributedDataParallel with gloo (recommended)"
            "none    one process"
            "fsdp    several CPU processes, the model sharded over them (FSDP2 with gloo)")
    fi
    if [[ $ASK != none ]]; then
        say "How should it train?"
        for i in "${!menu[@]}"; do say "  $((i + 1))) ${menu[i]}"; done
    fi
    MENU=("${menu[@]%% *}")
    ask "Mode" ddp multi-gpu
    MENU=()
}

# What it cannot guess about devices: the CPU processes for ddp and fsdp, or which GPU(s).
ask_devices() {
    [[ -z ${SET[gpus]:-}${SET[nproc]:-}${SET[gpu-ids]:-} ]] || return 0
    local mode=${SET[multi-gpu]:-ddp}
    if ! on_gpu; then
        [[ $mode != ddp && $mode != fsdp ]] || ask "CPU processes" "${RULES[default-processes]}" gpus
    elif ((${#FOUND_IDS[@]} > 1)); then
        if [[ $mode == none ]]; then
            ask "GPU id" "${FOUND_IDS[0]}" gpu-ids
        else
            ask "GPUs: all, a count (2 = the first two) or ids (0,2; one id as 3,)" all gpu-choice
        fi
    fi
}

ask_training() {
    local unit=process
    on_gpu && unit=GPU
    [[ -n ${SET[epochs]:-} ]] || ask "Epochs" "${RULES[default-epochs]}" epochs
    [[ -n ${SET[batch-size]:-} ]] || ask "Batch size per $unit" "${RULES[default-batch-size]}" batch-size
    [[ -n ${SET[lr]:-} ]] ||
        ask "Base learning rate (tuned for batch ${RULES[lr-base-batch]})" "${RULES[default-lr]}" lr
    if [[ -z ${SET[lr-scaling]:-} ]]; then
        if [[ $ASK != none ]]; then
            rules check || die_usage "${RULES[error]}"
            say "Effective batch: ${RULES[effective-batch]}"
        fi
        ask "Scale the LR for it: linear, sqrt or none" "${RULES[default-lr-scaling]}" lr-scaling
    fi
}

# A language model folder (-- --model hf --model-path FOLDER): LoRA adapters or every weight, and a 4-bit base.
ask_adapters() {
    [[ -n ${RULES[ask-lora]:-} ]] || return 0
    local default_qlora=${RULES[default-qlora]}
    ask "LoRA adapters' rank, e.g. 8 (0: fine-tune every weight)" "${RULES[default-lora-r]}" lora-r
    [[ ${SET[lora-r]} != 0 && -z ${SET[qlora]:-} ]] || return 0
    ask "Load the base in 4-bit, QLoRA (yes/no)" "$default_qlora" qlora
}

# --fault-tolerance: how often the replica groups sync (1: every step's gradients; more: DiLoCo's syncs, for
# slow links), unless said (--sync-every, or --semi-sync after --).
ask_sync_every() {
    [[ -n ${SET[fault-tolerance]:-} && -z ${SET[sync-every]:-} ]] || return 0
    rules check || die_usage "${RULES[error]}"
    [[ ${RULES[ask-sync-every]:-1} == 1 ]] || return 0
    ask "Sync the replica groups every how many steps (1 = every step; more: DiLoCo, for slow links)" 1 sync-every
}

# A --save-dir that holds another run's checkpoints: continue it, a new folder beside it, or
# overwrite it (the trainer keeps the old files aside until the new run saves). --yes: a new folder.
ask_save_dir() {
    rules check || die_usage "${RULES[error]}"
    [[ -n ${RULES[save-dir-holds]:-} ]] || return 0
    local answer=n
    if [[ $ASK != none ]]; then
        say "${SET[save-dir]} holds another run's checkpoints (${RULES[save-dir-holds]})."
        while true; do
            printf 'Continue that run (c), start in a new folder %s (n), or overwrite it (o)? [n]: ' \
                "${RULES[new-save-dir]}" >&2
            read_line || true
            answer=${LINE:-n}
            case ${answer,,} in c | n | o) break ;; esac
            say "  '$answer': answer c, n or o."
        done
    fi
    case ${answer,,} in
        c) PASSTHROUGH+=(--resume auto) ;;
        n) SET[save-dir]=${RULES[new-save-dir]} ;;
        o) PASSTHROUGH+=(--overwrite) ;;
    esac
}

confirm() {
    local question=$1 answer
    [[ $ASK == none ]] && return 0  # --yes, or nothing to ask
    while true; do
        printf '%s (y/n) [y]: ' "$question" >&2
        read_line || true
        answer=${LINE:-y}
        case ${answer,,} in
            y | yes) return 0 ;;
            n | no) say "Not done; the command above does it."; exit 0 ;;
        esac
        say "  '$answer': answer y or n."
    done
}

# --- the run, or the cluster job ----------------------------------------------------------------

show_plan() {
    say ""
    printf '%s\n' "${PLAN[@]}" >&2
}

# run_here [STEP]: the command of STEP (plan: a run here; ray: the training on Ray), printed, saved and run.
run_here() {
    rules "${1:-plan}" || die_usage "${RULES[error]}"
    show_plan
    say "Command:"
    printf '%s\n' "${RULES[command]}"
    ((DRY_RUN)) && exit 0
    confirm "Run it?"
    local file=${RULES[save-dir]}/launch_command.sh
    save_file "$file" --executable < <(
        echo "#!/usr/bin/env bash"
        echo "# Written by $PROG on $(date '+%Y-%m-%d %H:%M:%S'): repeats this run."
        echo "# Extra arguments go to main_multi_gpu.py, e.g. --resume auto."
        echo "cd $(printf '%q' "$PWD") || exit 1"
        echo "${RULES[command]} \"\$@\""
    )
    say "Saved as $file"
    say ""
    # The line is the rule set's, every word shell-quoted: run exactly what was printed and saved.
    eval "exec env ${RULES[command]}"
}

# write_job STEP: a cluster engine's job file (slurm: the sbatch script; k8s: the TrainJob), printed and saved;
# with --submit handed to the engine by submit_STEP.
write_job() {
    rules "$1" || die_usage "${RULES[error]}"
    show_plan
    local file=${RULES[script-file]}
    printf '%s' "${RULES[script]}"
    ((DRY_RUN)) && exit 0
    save_file "$file" < <(printf '%s' "${RULES[script]}")
    say "Saved as $file"
    ((SUBMIT)) || return 0
    confirm "Submit it?"
    "submit_$1" "$file"
}

submit_slurm() {
    local job
    command -v sbatch >/dev/null || die "sbatch not found: submit $1 from a SLURM login node"
    job=$(sbatch --parsable "$1") || die "sbatch refused $1 (its message is above)"
    say "Submitted job ${job%%;*}; its output: ${RULES[save-dir]}/slurm-${job%%;*}.out"
    printf '%s\n' "${job%%;*}"
}

submit_k8s() {
    command -v kubectl >/dev/null || die_usage "kubectl not found: apply $1 with kubectl where the cluster is reachable"
    kubectl apply -f "$1" >&2 || die "kubectl refused $1 (its message is above)"
    say "Applied; follow it with: kubectl get trainjob ${RULES[job-name]}"
}

# A cluster engine's flag (--slurm, --k8s, --ray), or --fault-tolerance (one process per group): no mode or device
# question (ddp, --gpus per node).
no_device_questions() { [[ -n ${SET[slurm]:-}${SET[k8s]:-}${SET[ray]:-}${SET[fault-tolerance]:-} ]]; }

main() {
    parse_args "$@"
    pick_python
    detect_devices
    rules check || die_usage "${RULES[error]}"
    decide_asking
    show_devices
    if ! no_device_questions; then
        [[ -n ${SET[multi-gpu]:-} ]] || ask_mode
        ask_devices
    fi
    ask_training
    ask_adapters
    ask_sync_every
    ask_save_dir
    if [[ -n ${SET[slurm]:-} ]]; then
        write_job slurm
    elif [[ -n ${SET[k8s]:-} ]]; then
        write_job k8s
    elif [[ -n ${SET[ray]:-} ]]; then
        run_here ray
    else
        run_here
    fi
}

main "$@"
