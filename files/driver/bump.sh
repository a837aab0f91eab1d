#!/bin/bash
# Managed by rigbook (roles/driver.py move_driver): the driver bump's apt step, run on the rig as
#
#     setsid -w /opt/rigbook/driver/bump.sh PACKAGE=VERSION...
#
# Releases the hold of each PACKAGE, installs it at VERSION (an apt version glob) and holds every
# PACKAGE that is on the system again on ANY exit: apt failing, a signal (HUP, INT, TERM), an error
# here. Only SIGKILL skips the hold. Run as one SSH command, the bump died with a dropped session
# that had a terminal (sshd hangs it up: SIGHUP) and left the driver unheld; so:
# - setsid puts this script in a session of its own: the hang-up of a dropped connection reaches
#   neither it nor apt, while `-w` still hands its exit status to the caller;
# - everything it and apt print goes to a log on the rig (LOG_DIR), replayed to the caller at the
#   end: nothing writes to the connection while apt runs, so a closed one cannot stop it either;
# - a trapped signal waits for apt to finish (bash runs the trap after the foreground command),
#   then the hold comes back.
set -u

LOG_DIR=${RIGBOOK_LOG_DIR:-/var/log/rigbook}
# Logs of earlier bumps kept beside this one's: the oldest beyond these go (log rotation).
KEEP_LOGS=10
# Debian package names (with an optional :arch) and apt version globs; nothing else gets to apt.
SPEC='^[a-z0-9][a-z0-9+.-]+(:[a-z0-9]+)?=[0-9][A-Za-z0-9.+~:*-]*$'

if (($# == 0)); then
    echo "usage: bump.sh PACKAGE=VERSION..." >&2
    exit 2
fi
names=()
for spec in "$@"; do
    if ! [[ $spec =~ $SPEC ]]; then
        printf 'bump.sh: not PACKAGE=VERSION: %q\n' "$spec" >&2
        exit 2
    fi
    names+=("${spec%%=*}")
done

# The named packages that are on the system: installed, or left half-way by a failed dpkg run
# (those must stay held too); not the unknown or removed ones.
present() {
    local name status
    for name in "${names[@]}"; do
        status=$(dpkg-query -W -f='${db:Status-Abbrev}' "$name" 2>/dev/null) || continue
        case ${status:1:1} in n | c | "") ;; *) echo "$name" ;; esac
    done
}

finish() {
    local rc=$? held
    trap '' HUP INT TERM
    mapfile -t held < <(present)
    if ((${#held[@]})) && ! apt-mark hold "${held[@]}"; then
        echo "bump.sh: could not hold ${held[*]} again"
        ((rc)) || rc=1
    fi
    cat "$log" >&3 2>/dev/null
    exit "$rc"
}

mkdir -p "$LOG_DIR" || exit
# Names sort by time (UTC stamp first): keep the newest KEEP_LOGS, this run's added after.
ls -1 "$LOG_DIR"/driver-bump-*.log 2>/dev/null | head -n -"$KEEP_LOGS" | xargs -r -d '\n' rm -f --
log=$LOG_DIR/driver-bump-$(date -u +%Y%m%dT%H%M%SZ)-$$.log
exec 3>&1 >"$log" 2>&1 </dev/null || exit
trap finish EXIT
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM

echo "bump.sh $* (log: $log)"
mapfile -t held < <(present)
if ((${#held[@]})); then
    apt-mark unhold "${held[@]}" || exit
fi
DEBIAN_FRONTEND=noninteractive apt-get -y -o Dpkg::Options::=--force-confdef \
    -o Dpkg::Options::=--force-confold install --allow-downgrades "$@"
