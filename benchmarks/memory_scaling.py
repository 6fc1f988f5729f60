"""Per-rank memory of ddp and fsdp at 1, 2 and 3 processes: what sharding saves (issue 22); with --mesh, the
memory and the collective traffic per optimizer step of each mesh shape at 4 processes (issue 41).

Each rank builds the same model (a stack of Linear+GELU blocks in an nn.Sequential, ≥ 50M parameters by
default), wraps it as the trainer does (DDP, or multigpu.parallel.sharding.shard: each block an FSDP unit, then the
root), and takes one AdamW step; then it counts the bytes of the tensors it holds itself, its shard under
fsdp: parameters, gradients and optimizer state. Under ddp that is 16 bytes per parameter on every rank;
under fsdp about 1/N of it. Beside it, the rank's peak resident memory (VmHWM, reset before each mode),
which also holds torch itself, DDP's gradient buckets and fsdp's gathered blocks.

    python benchmarks/memory_scaling.py                 # 50M parameters, N = 1, 2, 3 (CPU, gloo)
    python benchmarks/memory_scaling.py --small         # a tiny model: what CI runs
                                                        # (tests/benchmarks/test_memory_scaling.py)
    python benchmarks/memory_scaling.py --device cuda --processes 2     # GPUs, NCCL (gpu_check.sh's fsdp row)
    python benchmarks/memory_scaling.py --mesh          # ddp and the meshes 1x4, 2x2, 4x1 at 4 processes

--mesh: the same memory count for ddp and fsdp's meshes (replicate x shard) of 4 processes, then each mesh's
traffic per optimizer step, counted by the collectives themselves (bench_common.CollectiveTally): the bytes each
rank sends across the replicas (dp_replicate: between nodes, in the hybrid layout) and within its shard group
(dp_shard, or all ranks at 1x4: within a node), for one micro-step and for --grad-accum-steps 4 with
--fsdp-accumulate whole and sharded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_common import CollectiveTally, machine_line, markdown_table, mesh_labels, reset_cuda_peak  # noqa: E402

MODES = ("ddp", "fsdp")
SIZES = {"full": (2048, 12), "small": (64, 4)}  # (width, blocks): 50.4M and 17k parameters
# --mesh counts the traffic on a model of its own: bytes grow with the parameters, and 50M of them would take an
# hour through gloo on a small CPU machine (--small: the small model for both).
TRAFFIC_SIZE = (512, 4)  # 1.06M parameters
MESH_PROCESSES = 4
MESHES = ((1, 4), (2, 2), (4, 1))  # (replicate, shard) at MESH_PROCESSES
ACCUMULATIONS = {
    "none": (1, "whole"),
    "4 micro-steps, whole": (4, "whole"),
    "4 micro-steps, sharded": (4, "sharded"),
}


def build_model(width: int, blocks: int) -> Any:
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(blocks)], nn.Linear(width, 10)
    )


def local_bytes(tensors: Any) -> int:
    """Bytes this rank holds of `tensors`: a DTensor's local shard, a plain tensor whole."""
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the peak resident set size (VmHWM) of this process."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(
    mode: str,
    width: int,
    blocks: int,
    group: Any,
    device: Any,
    replicate: int = 1,
    count_traffic: bool = False,
) -> dict[str, Any]:
    """One AdamW step of the model under `mode` over the ranks of `group` (fsdp with `replicate` > 1: the hybrid
    mesh of all ranks); this rank's bytes of parameters, gradients and optimizer state, and under --mesh the
    traffic of each accumulation."""
    import gc

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from multigpu.parallel import sharding

    gc.collect()
    _reset_peak_rss()
    if device.type == "cuda":
        reset_cuda_peak(device)
    model = build_model(width, blocks).to(device)
    if mode == "fsdp":
        mesh = (
            DeviceMesh.from_group(group, device.type, mesh_dim_names=("dp",))
            if replicate == 1
            else sharding.device_mesh(device, dist.get_world_size(group), replicate)
        )
        sharding.shard(model, device, dist.get_world_size(group), mesh=mesh)
        trained = model
    else:
        trained = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.index is not None else None, process_group=group
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = torch.randn(4, width, device=device)
    nn.functional.cross_entropy(trained(inputs), torch.zeros(4, dtype=torch.long, device=device)).backward()
    optimizer.step()
    result = {
        "params": local_bytes(model.parameters()),
        "grads": local_bytes(p.grad for p in model.parameters()),
        "optimizer": local_bytes(
            value
            for state in optimizer.state.values()
            for value in state.values()
            if torch.is_tensor(value) and value.dim() > 0
        ),
        "largest_block": max(sum(p.numel() * 4 for p in block.parameters()) for block in model.children()),
        "parameters": sum(p.numel() for p in model.parameters()),
        "peak_rss": _peak_rss(),
        "peak_gpu": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
    }
    if count_traffic and mode == "fsdp":
        result["traffic"] = traffic(model, optimizer, width, device)
    del trained, model, optimizer
    gc.collect()
    return result


def traffic(model: Any, optimizer: Any, width: int, device: Any) -> dict[str, dict[str, list[float]]]:
    """Per optimizer step of the sharded `model`, which has taken a step (the first also gathers at the start),
    for each of ACCUMULATIONS: {group: [calls, bytes this rank sends]}."""
    import contextlib

    import torch
    import torch.nn as nn

    from multigpu.parallel import sharding

    labels = mesh_labels(next(model.parameters()).device_mesh)
    counted: dict[str, dict[str, list[float]]] = {}
    for name, (micro_steps, accumulate) in ACCUMULATIONS.items():
        inner = sharding.no_gradient_sync(model, accumulate == "sharded")
        with CollectiveTally(labels) as tally:
            for micro in range(micro_steps):
                inputs = torch.randn(4, width, device=device)
                with inner() if micro < micro_steps - 1 else contextlib.nullcontext():
                    loss = nn.functional.cross_entropy(
                        model(inputs), torch.zeros(4, dtype=torch.long, device=device)
                    )
                    (loss / micro_steps).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        counted[name] = {}
        for (group, _), (calls, _, sent) in tally.counts.items():
            total = counted[name].setdefault(group, [0, 0.0])
            total[0] += calls
            total[1] += sent
    return counted


def _rank(
    rank: int,
    sizes: list[int],
    width: int,
    blocks: int,
    folder: str,
    device_type: str,
    traffic_size: tuple[int, int] | None = None,
) -> None:
    """Rank `rank` of max(sizes) processes: for each world size N, the first N ranks measure both modes in a
    process group of their own, while the others wait (one start of the processes for every N). With
    `traffic_size` (--mesh; sizes: [MESH_PROCESSES]), every rank measures ddp and each of MESHES, and each mesh's
    traffic on a model of that (width, blocks)."""
    import torch
    import torch.distributed as dist

    os.environ.update(OMP_NUM_THREADS="1")
    device = torch.device(f"cuda:{rank}" if device_type == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"file://{folder}/store",
        rank=rank,
        world_size=max(sizes),
    )
    results: dict[Any, Any] = {}
    try:
        if traffic_size:
            results["ddp"] = measure("ddp", width, blocks, dist.group.WORLD, device)
            for replicate, shard in MESHES:
                one_model = traffic_size == (width, blocks)  # --small: memory and traffic of the same model
                result = measure(
                    "fsdp", width, blocks, dist.group.WORLD, device, replicate, count_traffic=one_model
                )
                counted = (
                    result
                    if one_model
                    else measure(
                        "fsdp", *traffic_size, dist.group.WORLD, device, replicate, count_traffic=True
                    )
                )
                results[f"{replicate}x{shard}"] = {
                    **result,
                    "traffic": counted["traffic"],
                    "traffic_parameters": counted["parameters"],
                }
        for size in [] if traffic_size else sizes:
            group = dist.new_group(list(range(size)))  # every rank takes part in creating each group
            if rank < size:
                results[size] = {mode: measure(mode, width, blocks, group, device) for mode in MODES}
            dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(folder, f"rank{rank}.json").write_text(json.dumps(results))


def run(
    sizes: list[int],
    width: int,
    blocks: int,
    device_type: str = "cpu",
    traffic_size: tuple[int, int] | None = None,
) -> dict[Any, Any]:
    """Every rank's measurements at each world size in `sizes` (real processes, spawned once: gloo, or NCCL on
    GPUs), by world size; with `traffic_size` (--mesh), by ddp and mesh shape at MESH_PROCESSES."""
    import torch.multiprocessing as mp

    # Every allocation above 128 KiB gets pages of its own, returned to the system when freed: otherwise glibc's
    # heap keeps what the first mode freed, and the second mode's peak RSS would include it.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    sizes = [MESH_PROCESSES] if traffic_size else sizes
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(
            _rank,
            args=(sizes, width, blocks, folder, device_type, traffic_size),
            nprocs=max(sizes),
            join=True,
        )
        ranks = [json.loads(Path(folder, f"rank{rank}.json").read_text()) for rank in range(max(sizes))]
    if traffic_size:
        return {shape: [rank[shape] for rank in ranks] for shape in ranks[0]}
    return {size: [ranks[rank][str(size)] for rank in range(size)] for size in sizes}


def held(rank: dict[str, int]) -> int:
    """A rank's bytes of parameters, gradients and optimizer state."""
    return sum(rank[key] for key in ("params", "grads", "optimizer"))


def mesh_tables(results: dict[str, list[dict[str, Any]]]) -> list[tuple[list[str], list[list[str]]]]:
    """--mesh: the memory per rank of ddp and each mesh, and each mesh's traffic per optimizer step."""
    ddp = held(results["ddp"][0])
    memory = (
        ["layout", "params+grads+optimizer per rank (MB)", "of ddp's", "ideal", "peak RSS per rank (MB)"],
        [],
    )
    for shape, ranks in results.items():
        shard = int(shape.split("x")[1]) if shape != "ddp" else 1
        name = "ddp" if shape == "ddp" else f"fsdp {shape}" if shape.startswith("1x") else f"hybrid {shape}"
        most = max(held(rank) for rank in ranks)
        memory[1].append(
            [
                name,
                f"{most / 1e6:.2f}",
                f"{most / ddp:.3f}",
                f"{1 / shard:.3f}",
                f"{max(rank['peak_rss'] for rank in ranks) / 1e6:.0f}",
            ]
        )
    traffic = (
        [
            "mesh",
            "accumulation",
            "across replicas: calls, MB sent per rank",
            "within the shard group: calls, MB sent per rank",
        ],
        [],
    )
    for shape, ranks in results.items():
        for accumulation in ACCUMULATIONS if shape != "ddp" else ():
            groups = ranks[0]["traffic"][accumulation]
            cells = []
            for names in (("dp_replicate",), ("dp_shard", "dp")):
                calls, sent = next((groups[name] for name in names if name in groups), (0, 0.0))
                cells.append(f"{calls}, {sent / 1e6:.3f}")
            traffic[1].append([shape, accumulation, *cells])
    return [memory, traffic]


def table(results: dict[int, list[dict[str, dict[str, int]]]]) -> tuple[list[str], list[list[str]]]:
    """Rows per mode and world size: rank 0's bytes (the largest shard), their share of ddp's, the most peak RSS."""
    header = [
        "mode",
        "processes",
        "params+grads+optimizer per rank (MB)",
        "of ddp's",
        "ideal 1/N",
        "peak RSS per rank (MB)",
        "peak GPU memory per rank (MB)",
    ]
    rows = []
    for mode in MODES:
        for world_size, ranks in sorted(results.items()):
            held = max(sum(rank[mode][key] for key in ("params", "grads", "optimizer")) for rank in ranks)
            ddp = sum(ranks[0]["ddp"][key] for key in ("params", "grads", "optimizer"))
            rows.append(
                [
                    mode,
                    str(world_size),
                    f"{held / 1e6:.1f}",
                    f"{held / ddp:.3f}",
                    f"{(1 if mode == 'ddp' else 1 / world_size):.3f}",
                    f"{max(rank[mode]['peak_rss'] for rank in ranks) / 1e6:.0f}",
                    f"{max(rank[mode]['peak_gpu'] for rank in ranks) / 1e6:.0f}"
                    if ranks[0][mode]["peak_gpu"]
                    else "-",
                ]
            )
    return header, rows


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--small", action="store_true", help="a tiny model (what CI runs)")
    parser.add_argument("--processes", default="1,2,3", help="world sizes, comma-separated")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU per process, NCCL"
    )
    shapes = ", ".join(f"{replicate}x{shard}" for replicate, shard in MESHES)
    parser.add_argument(
        "--mesh",
        action="store_true",
        help=f"ddp and fsdp's meshes {shapes} at {MESH_PROCESSES} "
        f"processes: memory, and traffic per optimizer step",
    )
    parser.add_argument("--json", help="also write the raw measurements here")
    args = parser.parse_args(argv)
    width, blocks = SIZES["small" if args.small else "full"]
    if args.mesh:
        return main_mesh(
            width, blocks, (width, blocks) if args.small else TRAFFIC_SIZE, args.device, args.json
        )
    results = run(sorted({int(part) for part in args.processes.split(",")}), width, blocks, args.device)
    parameters = next(iter(results.values()))[0]["ddp"]["parameters"]
    header, rows = table(results)
    print(
        f"Per-rank memory, {parameters / 1e6:.1f}M parameters (fp32, AdamW), {blocks} blocks of "
        f"Linear({width}, {width}) + GELU; {machine_line()}\n"
    )
    print(markdown_table(header, rows))
    if args.json:
        Path(args.json).write_text(json.dumps({str(n): ranks for n, ranks in results.items()}))
    return 0


def main_mesh(width: int, blocks: int, traffic_size: tuple[int, int], device: str, json_path: Any) -> int:
    results = run([], width, blocks, device, traffic_size)
    memory, traffic = mesh_tables(results)
    parameters = results["ddp"][0]["parameters"]
    print(
        f"Per-rank memory at {MESH_PROCESSES} processes, {parameters / 1e6:.2f}M parameters (fp32, AdamW), {blocks} "
        f"blocks of Linear({width}, {width}) + GELU; {machine_line()}\n"
    )
    print(markdown_table(*memory))
    print(
        f"\nCollective traffic per optimizer step, {results['2x2'][0]['traffic_parameters'] / 1e6:.2f}M parameters "
        f"({traffic_size[1]} blocks of Linear({traffic_size[0]}, {traffic_size[0]}) + GELU; batch 4 per micro-step; "
        f"ring algorithms: an all-reduce sends 2(n-1)/n of its bytes, a reduce-scatter or all-gather (n-1)/n):\n"
    )
    print(markdown_table(*traffic))
    if json_path:
        Path(json_path).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
