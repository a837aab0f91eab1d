"""The way back out: stop and remove what rigbook put on a rig.

    pyinfra inventory/rigs.py deploys/offboard.py --limit rig-dual3090 --dry
    pyinfra inventory/rigs.py deploys/offboard.py --limit rig-dual3090
    pyinfra inventory/rigs.py deploys/offboard.py --limit rig-dual3090 \\
        --data 'offboard_remove=["venvs", "models"]'

Stops and disables serving, the mirror, the guards and the power unit, sets the caps back to
each card's default, releases the driver's holds and removes every file docs/footprint.md lists
(the unit files, the drop-ins, the sysctl file, the /dev/shm line, the apt blacklist and pins,
rigbook's user, tokens, logs and programs). The driver, the venvs and the models stay unless
offboard_remove names them. A second run changes nothing. docs/runbooks/offboard.md walks
through it.
"""

from rigbook.jobs import offboard_rig

offboard_rig()
