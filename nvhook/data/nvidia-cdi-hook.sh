#!@SH@
# nvhook's nvidia-cdi-hook, first stage (docs/cdi-hook.md, "One process for a run of hooks").
# Written by the .deb's build, `nvhook node install` and the wheel's build (its bin/nvidia-cdi-hook,
# packaging/wheel/, naming the stages `nvhook setup` makes) with the paths filled in:
#   @SH@      a copy of the distribution's /bin/sh, root:GROUP, mode 2711 (set-group-ID). The
#             kernel sets AT_SECURE when it runs it (the effective gid changes), so the loader
#             ignores and removes LD_PRELOAD, LD_LIBRARY_PATH... of a container's environment
#             (runc hands it to a hook entry without `env`: CVE-2025-23266); dash and bash then
#             give the group back (effective gid := real gid) as they do when not run with -p.
#   @PYTHON@  the set-group-ID copy of python3 (the second stage, AT_SECURE again)
#   @STAGE2@  the python launcher of nvhook.start.cdihook
#   @MARKS@   the directory where the second stage records the hook entries it has already
#             done for this container (root's, mode 0700)
# Only the shell's builtins run here: a later entry of a run of entries that the second stage
# did in one process exits 0 at the cost of this shell's start; anything else goes to python.
IFS=' 	
'
LC_ALL=C
set -f
# This entry as the marker names it: the number of arguments and the bytes of "$*" (a marker
# line is read a byte per system call: the whole arguments would cost ~0.5 ms per kilobyte).
a=$*
a="$# ${#a}"
# Straight to python, stdin untouched, where the state is not on stdin or not read at all (a
# person running --version at a terminal): python tells these apart as NVIDIA's hook does.
direct=
[ -t 0 ] && direct=1
for x do
    case $x in
        -h | -h=* | --h | --h=* | -help | -help=* | --help | --help=* | -v | -v=* | --v | --v=* | \
        -version | -version=* | --version | --version=* | -container-spec | -container-spec=* | \
        --container-spec | --container-spec=*) direct=1 ;;
    esac
done
if [ -n "$direct" ]; then
    exec @PYTHON@ -IS @STAGE2@ --nvhook-first-stage @MARKS@ "$0" "$@"
fi
st=
l=
while IFS= read -r l; do
    st=$st$l'
'
    l=
done
st=$st$l

# 0 when the marker of this container (named by its id and this one's parent pid: two containers
# of one id, in two runtime roots, start at once) says that this entry is done: written by the
# process that is this one's parent, started at the same tick (the runtime's process that runs
# the container's hooks: another container, or a reused pid, has another), and the entry
# it names next has this one's shape (the runtime runs the entries in the spec's order). The
# entry is then taken off the marker.
done_already() {
    case $st in
        *\"id\":*) ;;
        *) return 1 ;;
    esac
    id=${st#*\"id\":}
    id=${id#"${id%%[! ]*}"}
    case $id in
        \"*) ;;
        *) return 1 ;;
    esac
    id=${id#\"}
    id=${id%%\"*}
    case $id in
        '' | .* | *[!A-Za-z0-9_.+-]*) return 1 ;;
    esac
    IFS= read -r s < /proc/self/stat || return 1
    s=${s##*) }
    set -- $s
    p=$2
    m=@MARKS@/$id.$p
    [ -f "$m" ] || return 1
    { take_off; } 3<> "$m" 2>/dev/null
}

# The marker open on fd 3 (read-write: a FIFO put there in a race does not block the open) and
# read and rewritten through it only, never by name again: a regular file that root owns (a
# user who can write in the directory, or owns it, plants no marker: the python stage wrote
# none there).
take_off() {
    [ -f /proc/self/fd/3 ] && [ -O /proc/self/fd/3 ] || return 1
    IFS= read -r h <&3 && IFS= read -r n <&3 || return 1
    [ "$n" = "$a" ] || return 1
    IFS= read -r s < "/proc/$p/stat" || return 1
    s=${s##*) }
    set -- $s
    [ "$h" = "$p ${20}" ] || return 1
    r=
    while IFS= read -r l <&3; do
        r=$r$l'
'
    done
    printf '%s\n%s' "$h" "$r" > /proc/self/fd/3 || return 1
}

if done_already; then
    exit 0
fi
if [ -z "$st" ]; then
    exec @PYTHON@ -IS @STAGE2@ --nvhook-first-stage @MARKS@ "$0" "$@" < /dev/null
fi
exec @PYTHON@ -IS @STAGE2@ --nvhook-first-stage @MARKS@ "$0" "$@" <<EOF
$st
EOF
