"""Host data every rig of this folder's inventory shares; a host's own data wins over it.
Every key is in docs/host-data.md."""

ssh_user = "root"
driver_branch = 580
