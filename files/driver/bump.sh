#!/bin/bash
# Managed by rigbook (roles/driver.py move_driver): the driver bump's apt step, run on the rig as
#
#     /opt/rigbook/driver/bump.sh --detach PACKAGE=VERSION...
#
# (without systemd as PID 1, --detach runs the apt step under `setsid -w` instead).
#
# Releases the hold of each PACKAGE, installs it at VERSION (an apt version glob) and holds every
# PACKAGE that is on the system again on ANY exit: apt failing, a signal (HUP, INT, TERM), an error
# here. Only SIGKILL skips the hold. Run as one SSH command, the bump died with a dropped session
# that had a terminal (sshd hangs it up: SIGHUP) and left the driver unheld; run under `setsid` it
# stayed in the SSH login's cgroup, which logind stops when the login ends where it has
# KillUserProcesses=yes; and `systemd-run --wait` ties the unit to its client, which dies with the
# login. So:
# - `--detach` starts the apt step (this script without --detach) as a transient unit of its own
#   (BUMP_UNIT, systemd-run without --wait): neither a hang-up nor the end of the login reaches
#   it or apt. Then it polls the unit until the apt step ended, prints its log and exits with its
#   status. Only that waiting is the caller's: a dropped connection ends the wait, not the bump;
# - the unit keeps its result after the apt step ended (RemainAfterExit=yes, no --collect) until
#   the wait read it, or the next --detach, which reports a result nobody read, then clears it;
# - a stop of the unit signals the apt step only (KillMode=mixed), not apt: the trap below lets
#   apt finish first;
# - everything it and apt print goes to a log on the rig (LOG_DIR); nothing writes to the
#   connection while apt runs, so a closed one cannot stop it either;
# - a trapped signal waits for apt to finish (bash runs the trap after the foreground command),
#   then the hold comes back.
set -u

LOG_DIR=${RIGBOOK_LOG_DIR:-/var/log/rigbook}
# Logs of earlier bumps kept beside this one's: the oldest beyond these go (log rotation).
KEEP_LOGS=10
# Debian package names (with an optional :arch) and apt version globs; nothing else gets to apt.
SPEC='^[a-z0-9][a-z0-9+.-]+(:[a-z0-9]+)?=[0-9][A-Za-z0-9.+~:*-]*$'
# The transient unit the apt step runs in (roles/driver.py BUMP_UNIT).
BUMP_UNIT=rigbook-driver-bump.service
# Longest a stop of the unit waits for apt (the trap lets it finish) before SIGKILL.
STOP_TIMEOUT=30min

detach=
if [[ ${1-} == --detach ]]; then
    detach=1
    shift
fi
if (($# == 0)); then
    echo "usage: bump.sh [--detach] PACKAGE=VERSION..." >&2
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

# One property of the unit (its value only).
prop() { systemctl show -P "$1" "$BUMP_UNIT"; }

# Print the log of the unit's ended apt step, clear the unit, exit as the apt step did: its exit
# status, 128 + the signal that killed it, 1 for another failure (systemd's Result).
report() {
    local result code status pid rc log
    result=$(prop Result) code=$(prop ExecMainCode) status=$(prop ExecMainStatus)
    pid=$(prop ExecMainPID)
    log=$(ls -1t "$LOG_DIR"/driver-bump-*-"$pid".log 2>/dev/null | head -1)
    if [[ -n $log ]]; then cat "$log"; else echo "bump.sh: no log of pid $pid in $LOG_DIR"; fi
    case $code in
        1) rc=$status ;;           # exited
        2 | 3) rc=$((128 + status)) ;;  # killed, dumped
        *) rc=0 ;;
    esac
    if [[ $result != success ]] && ((rc == 0)); then rc=1; fi
    ((rc == 0)) || echo "bump.sh: $BUMP_UNIT: $result (status $status)"
    systemctl stop "$BUMP_UNIT" 2>/dev/null
    systemctl reset-failed "$BUMP_UNIT" 2>/dev/null
    return "$rc"
}

# The unit's state: gone (no unit), running (the apt step runs), ended (its result is kept).
state() {
    case $(prop LoadState):$(prop SubState) in
        not-found:* | *:dead) echo gone ;;
        *:exited | *:failed) echo ended ;;
        *) echo running ;;
    esac
}

if [[ -n $detach && ! -d /run/systemd/system ]]; then
    # No systemd as PID 1 (a container, WSL2 without it): no unit and no logind session to
    # outlive; a session of its own keeps the hang-up of a dropped connection away.
    exec setsid -w "$0" "$@"
fi
if [[ -n $detach ]]; then
    case $(state) in
        running)
            echo "bump.sh: a driver bump is under way ($BUMP_UNIT since" \
                "$(prop ActiveEnterTimestamp)); wait until it ends, then run again" >&2
            exit 75
            ;;
        ended)
            echo "bump.sh: an earlier bump ended with nobody waiting for it; what it said:"
            report
            echo "bump.sh: (its result exit $?, reported above); this bump starts now"
            ;;
    esac
    systemd-run --unit="$BUMP_UNIT" --quiet -p RemainAfterExit=yes -p KillMode=mixed \
        -p TimeoutStopSec="$STOP_TIMEOUT" -E RIGBOOK_LOG_DIR="$LOG_DIR" -- "$0" "$@" || exit
    while [[ $(state) == running ]]; do sleep 1; done
    if [[ $(state) == gone ]]; then
        echo "bump.sh: $BUMP_UNIT went before its result was read; its logs: $LOG_DIR" >&2
        exit 1
    fi
    report
    exit
fi

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
