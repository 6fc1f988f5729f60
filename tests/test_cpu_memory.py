"""Freed CPU memory kept for the next step: fewer page faults per training step, switched by --cache-cpu-memory.

Each measurement runs in a fresh process: the setting is process-wide and glibc has no way back to its default.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from conftest import REPO, cli_env

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting applies to glibc's malloc")

# Page faults per step of a small convolution net (6 MB of activations per step), after two steps of warm-up.
CONV_STEPS = """
import json, resource, sys, torch
from multigpu import cpu_memory
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

# The same count inside the trainer's fit, from a callback at each step's end (steps 3 to 10).
TRAINER_STEPS = """
import json, resource, sys, tempfile, torch
from torch.utils.data import TensorDataset
from models import build_model
from train_multi_gpu import MultiGPUTrainer, TrainConfig
torch.set_num_threads(1)
class Faults:
    counts = []
    def on_step_end(self, trainer):
        self.counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
data = TensorDataset(torch.randn(640, 1, 28, 28), torch.randint(0, 10, (640,)))
config = TrainConfig(multi_gpu="none", epochs=1, batch_size=64, optimizer="sgd", lr=0.01, progress=False,
                     save_dir=tempfile.mkdtemp(), cache_cpu_memory=sys.argv[1] == "on")
faults = Faults()
MultiGPUTrainer(build_model("cnn", (1, 28, 28), 10), data, None, config, callbacks=[faults]).fit()
print(json.dumps((faults.counts[-1] - faults.counts[2]) / (len(faults.counts) - 3)))
"""


def faults_per_step(script: str, setting: str) -> float:
    done = subprocess.run([sys.executable, "-c", script, setting], cwd=REPO, env=cli_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_block_keeps_what_a_step_frees_for_the_next():
    given_back, kept = faults_per_step(CONV_STEPS, "off"), faults_per_step(CONV_STEPS, "on")
    assert given_back > 1000  # the activations come back as fresh pages, every step
    assert kept * 4 < given_back, (kept, given_back)


def test_fit_on_the_cpu_keeps_freed_memory_unless_told_not_to():
    kept, given_back = faults_per_step(TRAINER_STEPS, "on"), faults_per_step(TRAINER_STEPS, "off")
    assert given_back > 1000
    assert kept * 4 < given_back, (kept, given_back)
