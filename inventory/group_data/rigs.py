"""Host data every rig in inventory/rigs.py shares; a host's own data wins over it."""

ssh_user = "root"
driver_branch = 580
driver_open = True
driver_persistence = True
sysctl_inotify_max_user_watches = 1048576
sysctl_inotify_max_user_instances = 1024
