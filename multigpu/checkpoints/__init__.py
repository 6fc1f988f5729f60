"""Checkpoints: every byte a run writes to or reads from its save-dir.

Atomic one-file checkpoints and safe loads (checkpoint), sharded DCP folders (sharded) and their metadata read
without running code (dcp_metadata), the stateful protocol (stateful), the resume and save protocol
(checkpointer), weights read in other formats (weights) and written to them (export), safetensors files
(tensor_files), the save-dir's ownership (savedir), its numbered run folders and --overwrite's set-aside copy
(run_folders), and a run's saved settings (run_settings).

May import: the package root, multigpu.resilience, multigpu.parallel, multigpu.data and multigpu.loop.
savedir, run_folders and run_settings import no torch: the launcher asks them before anything is installed.
"""
