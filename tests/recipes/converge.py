"""TEST ONLY: the serving part of a converge on a sandbox rig: its venvs, then its recipe."""

from pyinfra import host

from rigbook.inventory import rig_of
from rigbook.roles.serving import serving
from rigbook.roles.venvs import venvs

rig = rig_of(host)
venvs(rig)
serving(rig)
