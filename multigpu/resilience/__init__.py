"""When things go wrong: where each rank is (heartbeat), clean stops on SIGTERM/SIGINT and lost ranks
(preemption), a torchrun worker that outlives its agent (agent_death), the hang doctor (watchdog, hang_report),
forks that cannot hang (fork_safety) and the test-only fault injector (faults).

Owns: threads and signal handlers that watch a run, and the words a failure is reported in.
May import: the package root (errors, config, safe_files) and torch. Nothing of the other subpackages: the
trainer hands the watchdog what it saves (a callable), so no module here knows a trainer.
"""
