"""TEST ONLY: the serving part of a converge on a sandbox rig: its venvs, then its recipe."""

from pyinfra import host

from rigbook.serving import serving
from rigbook.spec import rig_of
from rigbook.venvs import venvs

rig = rig_of(host)
venvs(rig)
serving(rig)
