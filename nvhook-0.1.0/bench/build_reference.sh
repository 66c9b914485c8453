#!/bin/sh
# Build NVIDIA's legacy hook chain for `make bench REFERENCE=OUT`, from NVIDIA's public
# sources checked out OUTSIDE this repository (nothing of theirs enters it):
#
#   bench/build_reference.sh TOOLKIT LIBNVC MODPROBE OUT
#
#   TOOLKIT   nvidia-container-toolkit at tag v1.17.0 (its vendor/ directory is used)
#   LIBNVC    libnvidia-container at its 1.17.0 sources
#   MODPROBE  nvidia-modprobe at tag 550.54.14 (libnvidia-container's Makefile would
#             download it; this points the build at a checkout instead)
#   OUT       gets nvidia-container-runtime-hook, nvidia-container-cli and its two
#             libraries (RUNPATH $ORIGIN, so nothing is installed system-wide)
#
# Needs Go >= 1.20 (Debian 12: golang-1.22-go from bookworm-backports), gcc, bmake, patchelf,
# rpcgen (rpcsvc-proto), pkg-config and libcap-dev libseccomp-dev libtirpc-dev libelf-dev.
# libnvidia-container links Debian's libelf and libtirpc instead of downloading elftoolchain
# and libtirpc (WITH_LIBELF=yes; glibc 2.36 has no SunRPC, so tirpc's headers and library
# are passed in); everything else is its own Makefile's defaults (WITH_NVCGO, WITH_SECCOMP).
set -eu
[ $# -eq 4 ] || { sed -n '2,21p' "$0"; exit 2; }
TOOLKIT=$(realpath "$1") LIBNVC=$(realpath "$2") MODPROBE=$(realpath "$3")
mkdir -p "$4"
OUT=$(realpath "$4")
GOBIN=$(ls -d /usr/lib/go-1.2*/bin 2>/dev/null | sort -V | tail -1 || true)
export PATH="${GOBIN:+$GOBIN:}$PATH" GOTOOLCHAIN=local GOFLAGS=-mod=vendor

(cd "$TOOLKIT" && go build -ldflags "-s -w" -o "$OUT/nvidia-container-runtime-hook" ./cmd/nvidia-container-runtime-hook)

# The Makefile's download step, done from the checkout: sources + NVIDIA's patch + stamp.
version=$(sed -n 's/^VERSION *:= *//p' "$LIBNVC/mk/nvidia-modprobe.mk")
src="$LIBNVC/deps/src/nvidia-modprobe-$version"
if [ ! -e "$src/.download_stamp" ]; then
    mkdir -p "$src"
    cp -a "$MODPROBE/modprobe-utils" "$src/"
    patch -d "$src" -p1 < "$LIBNVC/mk/nvidia-modprobe.patch"
    touch "$src/.download_stamp"
fi
# CPPFLAGS/LDLIBS through the environment: the Makefile appends them to its own (a
# command-line variable would replace them, nvidia-modprobe.mk's -DNV_LINUX included).
(cd "$LIBNVC" && CPPFLAGS="-isystem /usr/include/tirpc" LDLIBS="-ltirpc" \
    make WITH_LIBELF=yes WITH_TIRPC=no LIB_VERSION=1.17.0 LIB_TAG= \
         REVISION="$(git -C "$LIBNVC" rev-parse HEAD 2>/dev/null || echo unknown)")
cp "$LIBNVC/nvidia-container-cli" "$LIBNVC/libnvidia-container.so.1.17.0" \
   "$LIBNVC/deps/usr/local/lib/libnvidia-container-go.so.1.17.0" "$OUT/"
ln -sf libnvidia-container.so.1.17.0 "$OUT/libnvidia-container.so.1"
ln -sf libnvidia-container-go.so.1.17.0 "$OUT/libnvidia-container-go.so.1"
# The library dlopens libnvidia-container-go.so.1 and the CLI needs the library: both from OUT.
patchelf --set-rpath '$ORIGIN' "$OUT/nvidia-container-cli" "$OUT/libnvidia-container.so.1.17.0"
"$OUT/nvidia-container-cli" --version | head -2
