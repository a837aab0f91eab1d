"""What users would otherwise run, measured beside rigbook on the same fresh sandbox rigs.

Each peer converges the same subset of a rig's state (issue #22): the driver installed and held
with its unattended-upgrades blacklist, the power-limit unit, the sysctl file, the /dev/shm
size, stale files removed, and the guards' units and scripts. `render` writes the exact content
rigbook would write into a folder first, so every tool converges to identical files:

- `rig.yml`: an Ansible playbook, stock modules only, tuned as its users tune it (`ansible`);
- `pyinfra_stock.py`: the same with pyinfra's stock operations, no rigbook at run time;
- `rigbook_subset.py`: rigbook's own roles for that subset (driver, tuning, guards, power).
"""
