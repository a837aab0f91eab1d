"""pyinfra's deploy config for a rigbook folder (a clone of rigbook, or one `rigbook init` made),
which pyinfra loads before the inventory.

rigbook uses it for one thing: every host a run selects is checked before pyinfra connects to
any of them, however the hosts were given (an inventory file, `@local`, an inline host), with
the run's `--data`, `--limit` and `--exclude` (rigbook/inventory.py, docs/preflight.md). pyinfra
loads it from the folder it runs in (or `--chdir`) only; rigbook's inventory files run the same
check wherever pyinfra runs, and a job whose hosts neither checked refuses to go on.
"""

import sys

from rigbook.inventory import check_command_line

check_command_line(sys.argv)
