"""Delete leaked engine buffers in /dev/shm now, on every rig where no process holds them.

    pyinfra inventory/rigs.py deploys/reap_shm.py --limit rig-dual3090

vLLM unlinks its CPU KV-offload buffer (/dev/shm/vllm_offload_*.mmap) only on a graceful stop;
a force-killed engine leaks tens of GB of host RAM until reboot. The reaper (installed here if
it is not yet) deletes a file matching guards_shm_patterns only when it could read every
process's mappings and open files and none holds it. A held file is kept (no change); a process
it cannot read makes it refuse: that rig fails with the reason and nothing is deleted.
docs/guards.md has the details; rigbook-serve.service runs the same reaper after every stop.
"""

from rigbook.jobs import reap_shm

reap_shm()
