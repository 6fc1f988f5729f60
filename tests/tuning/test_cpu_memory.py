"""Freed CPU memory kept for the next step: fewer page faults per training step, switched by --cache-cpu-memory.

Each measurement runs in a fresh process: the setting is process-wide and glibc has no way back to its default.
"""

from __future__ import annotations

import ctypes
import json
import platform
import subprocess
import sys

import pytest

from conftest import REPO, cli_env

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the setting applies to glibc's malloc"
)

# Page faults per step of a small convolution net (6 MB of activations per step), after two steps of warm-up.
CONV_STEPS = """
import json, resource, sys, torch
from multigpu.tuning import cpu_memory
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Conv2d(1, 32, 3), torch.nn.ReLU(), torch.nn.Conv2d(32, 32, 3), torch.nn.ReLU(),
                            torch.nn.Flatten(), torch.nn.Linear(32 * 24 * 24, 10))
images, labels = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
def step():
    torch.nn.functional.cross_entropy(model(images), labels).backward()
    optimizer.step()
    optimizer.zero_grad()
with cpu_memory.kept_for_the_next_step(sys.argv[1] == "on"):
    step(); step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(8):
        step()
    print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 8))
"""

# glibc's own account of its memory (mallinfo2, glibc 2.33 and later).
MALLINFO = """
import ctypes, torch
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
"""

# The same count inside the trainer's fit, from a callback at each step's end (steps 4 to 10); and after the last
# step's count, how much of a live 24 MiB block malloc mapped on its own (bigger than any block the cnn frees, so
# above glibc's own threshold; below the raised one). Last: freeing a mapped block raises glibc's own thresholds.
# The block is made in a thread of its own, whose new malloc arena holds no free memory: in the main arena, a
# free chunk of 24 MiB that the training's steps left there (their heap reaches about 190 MB) would serve it
# under either setting.
TRAINER_STEPS = (
    MALLINFO
    + """
import json, resource, sys, tempfile, threading
from torch.utils.data import TensorDataset
from models import build_model
from train_multi_gpu import MultiGPUTrainer, TrainConfig
torch.set_num_threads(1)
class Faults:
    counts, mapped = [], None
    def on_step_end(self, trainer):
        self.counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        if len(self.counts) == trainer.total_steps:
            thread = threading.Thread(target=self.map_a_block)
            thread.start()
            thread.join()
    def map_a_block(self):
        block = torch.ones(6 * 1024 * 1024)
        self.mapped = libc.mallinfo2().hblkhd  # every arena's mapped blocks
        del block
data = TensorDataset(torch.randn(640, 1, 28, 28), torch.randint(0, 10, (640,)))
config = TrainConfig(multi_gpu="none", epochs=1, batch_size=64, optimizer="sgd", lr=0.01, progress=False,
                     save_dir=tempfile.mkdtemp(), cache_cpu_memory=sys.argv[1] == "on")
faults = Faults()
MultiGPUTrainer(build_model("cnn", (1, 28, 28), 10), data, None, config, callbacks=[faults]).fit()
print(json.dumps([(faults.counts[-1] - faults.counts[2]) / (len(faults.counts) - 3), faults.mapped]))
"""
)


# The free memory malloc holds after a 16 MiB block is dropped, in a fresh process (the block is mapped and unmapped)
# and then inside the block (kept); and the process's resident memory inside the block and after it (given back).
HELD_AFTER_A_FREE = (
    MALLINFO
    + """
import json, os
from multigpu.tuning import cpu_memory
def held_after_a_free():
    block = torch.ones(4 * 1024 * 1024)
    del block
    return libc.mallinfo2().fordblks
def resident():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = held_after_a_free()
with cpu_memory.kept_for_the_next_step(True):
    inside = held_after_a_free()
    resident_inside = resident()
print(json.dumps([before, inside, resident_inside - resident()]))
"""
)
MIB = 1024 * 1024
# What would tune malloc before the test does, and so spoil the comparison.
MALLOC_SETTINGS = (
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "GLIBC_TUNABLES",
    "LD_PRELOAD",
)


def run_script(script: str, *args: str) -> object:
    env = {name: value for name, value in cli_env().items() if name not in MALLOC_SETTINGS}
    done = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def skip_unless_steps_fault(given_back: float) -> None:
    if given_back < 1000:  # e.g. a kernel that faults in 2 MiB pages: nothing this test could tell apart
        pytest.skip(f"steps without the setting took only {given_back:.0f} page faults each on this machine")


def skip_without_mallinfo2() -> None:
    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("glibc before 2.33 has no mallinfo2")


def test_the_block_holds_freed_memory_and_gives_it_back_after():
    skip_without_mallinfo2()
    before, inside, given_back = run_script(HELD_AFTER_A_FREE)
    assert before < 16 * MIB  # a fresh process maps the block and unmaps it when it is freed
    assert inside >= 16 * MIB  # kept, for the next step
    assert given_back >= 15 * MIB  # the process's resident memory fell by the block once the block was left


@pytest.mark.slow
def test_the_block_keeps_what_a_step_frees_for_the_next():
    given_back, kept = run_script(CONV_STEPS, "off"), run_script(CONV_STEPS, "on")
    skip_unless_steps_fault(given_back)  # the activations come back as fresh pages
    assert kept * 4 < given_back, (kept, given_back)


@pytest.mark.slow
def test_fit_on_the_cpu_keeps_freed_memory_unless_told_not_to():
    skip_without_mallinfo2()
    (kept, mapped_on), (given_back, mapped_off) = (
        run_script(TRAINER_STEPS, "on"),
        run_script(TRAINER_STEPS, "off"),
    )
    assert mapped_off >= 24 * MIB > mapped_on, (
        mapped_on,
        mapped_off,
    )  # the switch: a block of its own, or not
    skip_unless_steps_fault(given_back)
    assert kept * 4 < given_back, (kept, given_back)


def test_a_malloc_tuned_through_the_environment_is_left_alone(monkeypatch):
    from multigpu.tuning import cpu_memory

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1000000")
    assert cpu_memory.tuned_by_the_user() and not cpu_memory.keep_freed_memory()
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")
    assert cpu_memory.tuned_by_the_user() and not cpu_memory.keep_freed_memory()
