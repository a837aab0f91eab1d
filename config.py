"""pyinfra's deploy config for this repository, which pyinfra loads before the inventory.

rigbook uses it for one thing: every host a run selects is checked before pyinfra connects to
any of them, however the hosts were given (an inventory file, `@local`, an inline host), with
the run's `--data`, `--limit` and `--exclude` (roles/inventory.py, docs/host-data.md). Run
pyinfra from the repository root, where this file is.
"""

import sys

from rigbook.inventory import check_command_line

check_command_line(sys.argv)
